// The TensorFlow-side helpers declared in tf_glue.h.
#include "tf_glue.h"

#include <string>

#include "tensorflow/core/util/overflow.h"

#if GOOGLE_CUDA
#include "tensorflow/core/framework/device_base.h"
#include "xla/stream_executor/stream.h"
#endif

namespace tensorflow {
namespace capsnet_ops {
namespace {

constexpr char kULayout[] = "(batch, in_caps, in_dim)";
constexpr char kWLayout[] = "(in_caps, out_caps, out_dim, in_dim)";

// "u [2,3,4] and W [3,5,6,4]": the two input shapes every error names.
std::string Inputs(const TensorShape& u, const TensorShape& w) {
  return "u " + u.DebugString() + " and W " + w.DebugString();
}

std::string AllInputs(InferenceContext* c) {
  std::string all;
  for (int x = 0; x < c->num_inputs(); ++x) {
    all += (x ? ", " : "") + c->DebugString(c->input(x));
  }
  return all;
}

}  // namespace

absl::Status MergeNamed(InferenceContext* c, ShapeHandle a, int a_dim,
                        const char* a_name, ShapeHandle b, int b_dim,
                        const char* b_name, const char* what,
                        DimensionHandle* out, const char* op) {
  DimensionHandle da = c->Dim(a, a_dim), db = c->Dim(b, b_dim);
  if (c->ValueKnown(da) && c->ValueKnown(db) && c->Value(da) != c->Value(db)) {
    return errors::InvalidArgument(
        op, ": ", what, " disagrees between ", a_name, " ",
        c->DebugString(a), " (dim ", a_dim, " = ", c->Value(da), ") and ", b_name,
        " ", c->DebugString(b), " (dim ", b_dim, " = ", c->Value(db), ")");
  }
  return c->Merge(da, db, out);
}

absl::Status WithRankNamed(InferenceContext* c, int input, int rank,
                           const char* name, const char* layout,
                           ShapeHandle* out, const char* op) {
  ShapeHandle s = c->input(input);
  if (c->RankKnown(s) && c->Rank(s) != rank) {
    return errors::InvalidArgument(op, ": ", name, " must have rank ",
                                   rank, " ", layout, " but has shape ",
                                   c->DebugString(s), " (input shapes: ", AllInputs(c), ")");
  }
  return c->WithRank(s, rank, out);
}

absl::Status WithInputRanks(InferenceContext* c, int u_input, int w_input, ShapeHandle* u,
                            ShapeHandle* w, const char* op) {
  TF_RETURN_IF_ERROR(WithRankNamed(c, u_input, 3, "u", kULayout, u, op));
  return WithRankNamed(c, w_input, 4, "W", kWLayout, w, op);
}

absl::Status MergeInputDims(InferenceContext* c, ShapeHandle u, ShapeHandle w,
                            DimensionHandle* in_caps, DimensionHandle* in_dim, const char* op) {
  TF_RETURN_IF_ERROR(MergeNamed(c, u, 1, "u", w, 0, "W", "in_caps", in_caps, op));
  return MergeNamed(c, u, 2, "u", w, 3, "W", "in_dim", in_dim, op);
}

void SetGradOutputShapes(InferenceContext* c, DimensionHandle batch, DimensionHandle in_caps,
                         DimensionHandle in_dim, DimensionHandle out_caps,
                         DimensionHandle out_dim) {
  c->set_output(0, c->MakeShape({batch, in_caps, in_dim}));
  c->set_output(1, c->MakeShape({in_caps, out_caps, out_dim, in_dim}));
}

absl::Status CheckOutputFits(InferenceContext* c, ShapeHandle out, const char* what,
                             const char* op) {
  if (!c->FullyDefined(out)) return absl::OkStatus();
  // The element count as TensorShape computes it: dimension by dimension.
  int64_t n = 1;
  for (int x = 0; x < c->Rank(out); ++x) {
    n = MultiplyWithoutOverflow(n, c->Value(c->Dim(out, x)));
    if (n < 0) {
      return errors::InvalidArgument(op, ": ", what, " ", c->DebugString(out),
                                     " has more elements than int64 can count (input shapes: ",
                                     AllInputs(c), ")");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckedShape(std::initializer_list<int64_t> dims, const char* what,
                          const TensorShape& u, const TensorShape& w, const char* op,
                          TensorShape* out) {
  if (TensorShape::BuildTensorShape(dims, out).ok()) return absl::OkStatus();
  std::string sizes;
  for (int64_t x : dims) sizes += (sizes.empty() ? "" : ",") + std::to_string(x);
  return errors::InvalidArgument(op, ": ", what, " [", sizes,
                                 "] has more elements than int64 can count, for ",
                                 Inputs(u, w));
}

absl::Status CheckForwardShapes(const TensorShape& u, const TensorShape& w,
                                CapsuleDims* dims, const char* op, TensorShape* u_hat) {
  if (u.dims() != 3 || w.dims() != 4) {
    return errors::InvalidArgument(
        op, ": u must be ", kULayout, " and W ", kWLayout,
        ", got u ", u.DebugString(), " and W ", w.DebugString());
  }
  if (u.dim_size(1) != w.dim_size(0)) {
    return errors::InvalidArgument(
        op, ": in_caps disagrees between u ", u.DebugString(),
        " (dim 1) and W ", w.DebugString(), " (dim 0)");
  }
  if (u.dim_size(2) != w.dim_size(3)) {
    return errors::InvalidArgument(
        op, ": in_dim disagrees between u ", u.DebugString(),
        " (dim 2) and W ", w.DebugString(), " (dim 3)");
  }
  *dims = {u.dim_size(0), u.dim_size(1), w.dim_size(1), w.dim_size(2), u.dim_size(2)};
  TensorShape shape;
  TF_RETURN_IF_ERROR(CheckedShape({dims->batch, dims->in_caps, dims->out_caps, dims->out_dim},
                                  "u_hat (batch, in_caps, out_caps, out_dim)", u, w, op, &shape));
  if (u_hat != nullptr) *u_hat = shape;
  return absl::OkStatus();
}

absl::Status AllocateGradOutputs(OpKernelContext* ctx, const TensorShape& u, const TensorShape& w,
                                 Tensor** grad_u, Tensor** grad_w) {
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, u, grad_u));
  return ctx->allocate_output(1, w, grad_w);
}

#if GOOGLE_CUDA

// The CUDA stream TensorFlow runs this op's kernels on.
absl::Status GetGpuStream(OpKernelContext* ctx, capsnet::GpuStream* stream) {
  const DeviceContext* dc = ctx->op_device_context();
  if (dc == nullptr || dc->stream() == nullptr ||
      dc->stream()->platform_specific_handle().stream == nullptr) {
    return errors::Internal("capsule_prediction: no CUDA stream for device ",
                            ctx->device()->name());
  }
  *stream = static_cast<capsnet::GpuStream>(dc->stream()->platform_specific_handle().stream);
  return absl::OkStatus();
}

absl::Status LaunchStatus(int status, const char* what, const char* op) {
  if (status == 0) return absl::OkStatus();
  return errors::Internal(op, ": CUDA launch of the ", what,
                          " kernels failed: ", capsnet::GpuErrorString(status));
}

#endif  // GOOGLE_CUDA

}  // namespace capsnet_ops
}  // namespace tensorflow

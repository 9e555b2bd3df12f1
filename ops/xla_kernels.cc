// XLA kernels of the four ops, so that a jit-compiled computation
// (tf.function(jit_compile=True), train.xla=jit) can contain them: each lowers
// its op to a typed-FFI custom call whose handlers (xla_handlers.cc) run our
// CPU kernels on the host and our CUDA kernels on the GPU. XLA compiles the
// rest of the step around them (convolutions, decoder, losses, optimizer).
//
// The custom calls return a tuple: the op's outputs and, on the GPU, the
// launchers' workspace (uint8, sized here from the shape), which XLA allocates
// with the step's other buffers.
//
// Every operand and result is pinned to the row-major layout the kernels index
// by. A custom call without layouts lets XLA's layout assignment pick them to suit
// its neighbours (on the GPU, e.g. u_hat laid out for the routing's batched dot),
// and the typed-FFI handler sees only dimensions, so the kernels would read and
// write the wrong elements. That is why the unfused op path (op prediction + TF
// routing) under train.xla=jit trained into a collapsed model on a GPU while the
// fused op's runs trained well; with the layouts pinned it trains (H100;
// docs/verification.md).
#include <string>
#include <vector>

#include "capsnet_kernels.h"
#include "tensorflow/compiler/tf2xla/type_util.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/kernel_def_builder.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tf_glue.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

namespace tensorflow {
namespace capsnet_ops {
namespace {

// xla_handlers.cc registers its handlers under these names.
constexpr char kPredictionTarget[] = "capsnet_capsule_prediction";
constexpr char kPredictionGradTarget[] = "capsnet_capsule_prediction_grad";
constexpr char kRoutingTarget[] = "capsnet_capsule_routing";
constexpr char kRoutingGradTarget[] = "capsnet_capsule_routing_grad";

// What each custom call returns besides the op's outputs: the GPU launchers'
// workspace bytes for the shape (0 and no workspace on the host).
enum class Workspace { kNone, kPredictionGrad, kRouting, kRoutingGrad };

#if GOOGLE_CUDA
template <typename G>
std::size_t WorkspaceBytesFor(Workspace w, const ::capsnet::CapsuleDims& d, int iterations) {
  switch (w) {
    case Workspace::kPredictionGrad:
      return ::capsnet::CapsulePredictionGradWorkspaceBytes<G>(d);
    case Workspace::kRouting:
      return ::capsnet::CapsuleRoutingWorkspaceBytes<G>(d, iterations);
    case Workspace::kRoutingGrad:
      return ::capsnet::CapsuleRoutingGradWorkspaceBytes<G>(d);
    case Workspace::kNone:
      break;
  }
  return 0;
}

std::size_t GpuWorkspaceBytes(DataType type, Workspace w, const ::capsnet::CapsuleDims& d,
                              int iterations) {
  switch (type) {
    case DT_FLOAT:
      return WorkspaceBytesFor<float>(w, d, iterations);
    case DT_DOUBLE:
      return WorkspaceBytesFor<double>(w, d, iterations);
    case DT_HALF:
      return WorkspaceBytesFor<::capsnet::half_t>(w, d, iterations);
    case DT_BFLOAT16:
      return WorkspaceBytesFor<::capsnet::bfloat16_t>(w, d, iterations);
    default:
      return 0;
  }
}
#endif  // GOOGLE_CUDA

// The shared part of the four kernels: the custom call to `target` on the op's
// inputs, with outputs of `shapes` (plus the workspace on the GPU), and its
// tuple elements as the op's outputs.
class CustomCallKernel : public XlaOpKernel {
 public:
  CustomCallKernel(OpKernelConstruction* ctx, const char* target, Workspace workspace)
      : XlaOpKernel(ctx),
        target_(target),
        workspace_(workspace),
        on_gpu_(ctx->device_type() == DeviceType(DEVICE_GPU_XLA_JIT)) {}

 protected:
  // `backend_config`: the handler's attributes as an MLIR dictionary ("" for none).
  void Emit(XlaOpKernelContext* ctx, const ::capsnet::CapsuleDims& d,
            const std::vector<TensorShape>& shapes, int iterations,
            const std::string& backend_config) {
    xla::PrimitiveType type;
    OP_REQUIRES_OK(ctx, DataTypeToPrimitiveType(ctx->input_type(0), &type));
    std::vector<xla::Shape> results;
    for (const TensorShape& s : shapes) {
      results.push_back(xla::ShapeUtil::MakeShapeWithDescendingLayout(type, s.dim_sizes()));
    }
    if (on_gpu_ && workspace_ != Workspace::kNone) {
#if GOOGLE_CUDA
      const std::size_t bytes = GpuWorkspaceBytes(ctx->input_type(0), workspace_, d, iterations);
      results.push_back(
          xla::ShapeUtil::MakeShapeWithDescendingLayout(xla::U8, {static_cast<int64_t>(bytes)}));
#else
      ctx->SetStatus(errors::Unimplemented(
          target_, ": the capsnet op library was built without CUDA; rebuild it with nvcc "
          "found (make ops) to jit-compile the op on a GPU"));
      return;
#endif
    }
    std::vector<xla::XlaOp> operands;
    std::vector<xla::Shape> operand_layouts;
    for (int i = 0; i < ctx->num_inputs(); ++i) {  // every input of the four ops has type T
      operands.push_back(ctx->Input(i));
      operand_layouts.push_back(
          xla::ShapeUtil::MakeShapeWithDescendingLayout(type, ctx->InputShape(i).dim_sizes()));
    }
    xla::XlaOp call = xla::CustomCallWithLayout(
        ctx->builder(), target_, operands, xla::ShapeUtil::MakeTupleShape(results),
        operand_layouts, backend_config, /*has_side_effect=*/false,
        /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
        xla::CustomCallSchedule::SCHEDULE_NONE,
        xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    for (int i = 0; i < static_cast<int>(shapes.size()); ++i) {
      ctx->SetOutput(i, xla::GetTupleElement(call, i));
    }
  }

 private:
  const char* target_;
  Workspace workspace_;
  bool on_gpu_;
};

// InvalidArgument naming every input shape unless input `index` has shape `want`.
absl::Status CheckInput(XlaOpKernelContext* ctx, int index, const char* name,
                        const TensorShape& want, const char* op) {
  if (ctx->InputShape(index) == want) return absl::OkStatus();
  std::string shapes;
  for (int i = 0; i < ctx->num_inputs(); ++i) {
    shapes += (i ? ", " : "") + ctx->InputShape(i).DebugString();
  }
  return errors::InvalidArgument(op, " gradient: ", name, " ", ctx->InputShape(index).DebugString(),
                                 " must be ", want.DebugString(), " (inputs: ", shapes, ")");
}

class CapsulePredictionXla : public CustomCallKernel {
 public:
  explicit CapsulePredictionXla(OpKernelConstruction* ctx)
      : CustomCallKernel(ctx, kPredictionTarget, Workspace::kNone) {}

  void Compile(XlaOpKernelContext* ctx) override {
    ::capsnet::CapsuleDims d;
    TensorShape u_hat;
    OP_REQUIRES_OK(ctx, CheckForwardShapes(ctx->InputShape(0), ctx->InputShape(1), &d,
                                           kPredictionOp, &u_hat));
    Emit(ctx, d, {u_hat}, 0, "");
  }
};

class CapsulePredictionGradXla : public CustomCallKernel {
 public:
  explicit CapsulePredictionGradXla(OpKernelConstruction* ctx)
      : CustomCallKernel(ctx, kPredictionGradTarget, Workspace::kPredictionGrad) {}

  void Compile(XlaOpKernelContext* ctx) override {  // grad, u, W
    ::capsnet::CapsuleDims d;
    TensorShape u_hat;
    OP_REQUIRES_OK(ctx, CheckForwardShapes(ctx->InputShape(1), ctx->InputShape(2), &d,
                                           kPredictionOp, &u_hat));
    OP_REQUIRES_OK(ctx, CheckInput(ctx, 0, "grad", u_hat, kPredictionOp));
    Emit(ctx, d, {ctx->InputShape(1), ctx->InputShape(2)}, 0, "");
  }
};

class CapsuleRoutingXla : public CustomCallKernel {
 public:
  explicit CapsuleRoutingXla(OpKernelConstruction* ctx)
      : CustomCallKernel(ctx, kRoutingTarget, Workspace::kRouting) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("iterations", &iterations_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("leaky", &leaky_));
  }

  void Compile(XlaOpKernelContext* ctx) override {  // u, W
    ::capsnet::CapsuleDims d;
    OP_REQUIRES_OK(ctx, CheckForwardShapes(ctx->InputShape(0), ctx->InputShape(1), &d,
                                           kRoutingOp));
    // Both attributes always: the handlers bind both (the workspace does not depend on
    // leaky).
    Emit(ctx, d,
         {TensorShape({d.batch, d.out_caps, d.out_dim}),
          TensorShape({d.batch, d.in_caps, d.out_caps})},
         iterations_,
         "{iterations = " + std::to_string(iterations_) +
             " : i32, leaky = " + (leaky_ ? "true" : "false") + "}");
  }

 private:
  int iterations_;
  bool leaky_;
};

class CapsuleRoutingGradXla : public CustomCallKernel {
 public:
  explicit CapsuleRoutingGradXla(OpKernelConstruction* ctx)
      : CustomCallKernel(ctx, kRoutingGradTarget, Workspace::kRoutingGrad) {}

  void Compile(XlaOpKernelContext* ctx) override {  // u, W, c_ij, grad_s
    ::capsnet::CapsuleDims d;
    OP_REQUIRES_OK(ctx, CheckForwardShapes(ctx->InputShape(0), ctx->InputShape(1), &d,
                                           kRoutingOp));
    OP_REQUIRES_OK(ctx, CheckInput(ctx, 2, "c_ij", TensorShape({d.batch, d.in_caps, d.out_caps}),
                                   kRoutingOp));
    OP_REQUIRES_OK(ctx, CheckInput(ctx, 3, "grad_s", TensorShape({d.batch, d.out_caps, d.out_dim}),
                                   kRoutingOp));
    Emit(ctx, d, {ctx->InputShape(0), ctx->InputShape(1)}, 0, "");
  }
};

// ----------------------------------------------------------------------------
// Registration. REGISTER_XLA_OP only records the kernels: TensorFlow turns the
// records into kernels of its XLA devices once per process, at its first
// function instantiation (XlaOpRegistry::RegisterCompilationKernels), which in
// eager mode is the first op it runs. A library loaded after that, as ours is
// (lazily, on the first capsule op), would never get kernels there, so when
// that has happened already the kernels are registered here directly, as that
// function would have.

template <typename Kernel>
OpKernel* Create(OpKernelConstruction* ctx) {
  return new Kernel(ctx);
}

struct Registration {
  const char* op;
  XlaOpRegistry::Factory factory;
};

constexpr Registration kRegistrations[] = {
    {"Capsnet>CapsulePrediction", Create<CapsulePredictionXla>},
    {"Capsnet>CapsulePredictionGrad", Create<CapsulePredictionGradXla>},
    {"Capsnet>CapsuleRouting", Create<CapsuleRoutingXla>},
    {"Capsnet>CapsuleRoutingGrad", Create<CapsuleRoutingGradXla>},
};

REGISTER_XLA_OP(Name("Capsnet>CapsulePrediction"), CapsulePredictionXla);
REGISTER_XLA_OP(Name("Capsnet>CapsulePredictionGrad"), CapsulePredictionGradXla);
REGISTER_XLA_OP(Name("Capsnet>CapsuleRouting"), CapsuleRoutingXla);
REGISTER_XLA_OP(Name("Capsnet>CapsuleRoutingGrad"), CapsuleRoutingGradXla);

// Whether TensorFlow has made its XLA devices' kernels already: Identity has
// one on every XLA device once it has.
bool CompilationKernelsRegistered(const char* device) {
  NodeDef probe;
  probe.set_name("capsnet_probe");
  probe.set_op("Identity");
  AddNodeAttr("T", DT_FLOAT, &probe);
  const KernelDef* def = nullptr;
  return FindKernelDef(DeviceType(device), probe, &def, nullptr).ok();
}

bool RegisterLate() {
  for (const char* device : {DEVICE_CPU_XLA_JIT, DEVICE_GPU_XLA_JIT}) {
    if (!XlaOpRegistry::IsBackendRegistered(device) || !CompilationKernelsRegistered(device)) {
      continue;  // not made yet: RegisterCompilationKernels will include ours
    }
    for (const Registration& r : kRegistrations) {
      const KernelDef* def = KernelDefBuilder(r.op)
                           .Device(device)
                           .TypeConstraint("T", {DT_HALF, DT_BFLOAT16, DT_FLOAT, DT_DOUBLE})
                           .Build();
      // Owned by the kernel registry for the life of the process, as
      // RegisterCompilationKernels' registrars are.
      new kernel_factory::OpKernelRegistrar(def, "XlaJitOp", r.factory);
    }
  }
  return true;
}

// After the REGISTER_XLA_OP records above (same file: initialised in order).
const bool registered_late = RegisterLate();

}  // namespace
}  // namespace capsnet_ops
}  // namespace tensorflow

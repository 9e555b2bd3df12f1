"""The paper model at initialisation on a batch of uniform noise with random labels: its
capsule lengths and the size of each variable's gradient against Adam's epsilon (1e-7),
per batch size. Run on the CPU (a minute): `.venv/bin/python scripts/probe_init_gradients.py`.

Why it exists: [reliability] item 3 (docs/verification.md): the paper model at batch 2048
on a repeated synthetic batch sat at loss 0.8426 on an H100; this shows what that loss is.
"""
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capsnet.model import build_model
from capsnet.losses import capsnet_losses

keras.utils.set_random_seed(0)
model = build_model()
rng = np.random.default_rng(0)
for batch in (512, 2048):
    x = tf.constant(rng.uniform(0, 1, (batch, 28, 28, 1)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, batch).astype(np.int32))
    with tf.GradientTape() as tape:
        out = model(x, labels=y, training=True)
        total, margin, rec = capsnet_losses(x, y, out, m_plus=0.9, m_minus=0.1, lambda_=0.5, reconstruction_weight=0.0005)
        loss = tf.reduce_mean(total)
    grads = tape.gradient(loss, model.trainable_variables)
    lengths = out["lengths"].numpy()
    print(f"batch {batch}: loss {float(loss):.4f} margin {float(tf.reduce_mean(margin)):.4f} lengths mean {lengths.mean():.2e} max {lengths.max():.2e}", flush=True)
    for v, g in zip(model.trainable_variables, grads):
        g = g.numpy()
        rms = float(np.sqrt(np.mean(g ** 2)))
        print(f"  {v.path:60s} rms {rms:.2e}  median|g| {np.median(np.abs(g)):.2e}  frac|g|<1e-7 {np.mean(np.abs(g) < 1e-7):.2f}", flush=True)

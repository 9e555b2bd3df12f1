"""capsnet: CapsNet (Sabour, Frosst & Hinton 2017) on TensorFlow 2."""
__version__ = "0.1.0"

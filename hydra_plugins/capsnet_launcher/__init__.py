"""capsnet's Hydra launcher plugin (`hydra/launcher=gpus`): hydra_plugins/capsnet_launcher/gpus.py.

Hydra instantiates launchers only from the `hydra_plugins` namespace package, which it
finds on sys.path: the repository root (train.py's directory) or an installed capsnet.
"""

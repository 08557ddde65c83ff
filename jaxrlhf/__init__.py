"""jaxrlhf: post-training language models in JAX/Flax."""

from jaxrlhf import console

# Before TensorFlow is first imported (its C++ logging reads the environment
# then); see jaxrlhf.console.
console.silence_library_noise()

__version__ = "0.1.0"

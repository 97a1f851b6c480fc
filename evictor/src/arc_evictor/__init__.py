"""arc-evictor: prefix-cache eviction policies (``policies``) and the vLLM plugin that drives
vLLM's block pool with them (``vllm_plugin``). What a serving pod installs."""

__version__ = "0.1.0"

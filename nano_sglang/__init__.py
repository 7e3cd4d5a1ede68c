"""nano_sglang: SGLang (Zheng et al., arXiv 2312.07104) over nano_vllm."""

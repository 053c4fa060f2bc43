"""This library's drafters inside serving engines (vLLM's ``custom_class`` proposers: :mod:`.vllm`)."""

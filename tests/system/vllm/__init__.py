"""Real vLLM engines through kvstage's connector (`make test-vllm`)."""

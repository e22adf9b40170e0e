"""Running a scheduled step on the model: inputs prepared, the forward (eager or a CUDA graph),
logits sampled, prompt logprobs computed."""

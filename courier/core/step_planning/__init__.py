"""How a batched step is planned: prefill budget, prompt-lookup drafts, verify width."""

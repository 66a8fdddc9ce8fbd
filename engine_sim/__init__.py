"""A vLLM look-alike engine simulator that moves KV through a real Mooncake Store.

Run one with `python -m engine_sim --role prefill|decode|both ...`. It tokenizes with the
router's `router.tokenization` (a real tokenizer; `engine_sim.prompts`); the pieces it
shares with the router's tests: `engine_sim.block_hash`
(hash_prompt_blocks), `engine_sim.kv_params` (the kv_transfer_params shape) and, for tests,
`engine_sim.generation.expected_text`.
"""

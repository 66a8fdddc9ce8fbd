"""A vLLM look-alike engine simulator that moves KV through a real Mooncake Store.

Run one with `python -m engine_sim --role prefill|decode|both ...`. The pieces the router
shares with it: `engine_sim.tokenizer` (render_chat, encode), `engine_sim.block_hash`
(hash_prompt_blocks), `engine_sim.kv_params` (the kv_transfer_params shape) and, for tests,
`engine_sim.generation.expected_text`.
"""

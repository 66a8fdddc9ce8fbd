"""pdgate's benchmark harness: pdgate next to vLLM Router and SGLang's router, same pods.

`python -m benchmarks [--quick]` starts a Mooncake master, simulated engine pods and each
router under test (one at a time under load), drives seeded workloads through them with an
async load generator, and writes raw JSON, a Markdown table and PNG plots to
`benchmarks/results/<date>/`. See `benchmarks/README.md` for the method.
"""

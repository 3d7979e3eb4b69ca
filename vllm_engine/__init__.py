"""vLLM engines as kvtier serving instances (docs/vllm.md): what the serve graph drives when
it runs `engine: vllm`, beside the KV connector (kvtier.connector) that gives each engine
kvtier's L2 and L3."""

"""The model shapes a config names with `preset = NAME` ([model] section, or --model.preset): Meta's Llama 3 shapes,
two mixtures of experts of the field's current shape, and the small ones the tests and CPU runs use.
Fields a config sets after the preset override it (config.parse_config)."""
from __future__ import annotations

PRESETS: dict[str, dict] = {
    # Tiny CPU model for the debug config and the tests.
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=4096, ffn_dim=384,
                  max_seq_len=512),
    # GPT-2 small's shape (hence the name; GPT-2's 124M ties its 50k-token embedding to the output):
    # with an untied embedding and output, 179M parameters, 103M of them outside the two.
    "llama_125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=3, vocab_size=50_000,
                       ffn_dim=3072, max_seq_len=2048),
    # Llama 3.2 1B and Llama 3 8B shapes (without Llama 3.1's RoPE frequency scaling).
    "llama3_1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128_256,
                      ffn_dim=8192, max_seq_len=8192, rope_theta=500_000.0),
    "llama3_8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256,
                      ffn_dim=14_336, max_seq_len=8192, rope_theta=500_000.0),
    # Llama 3 70B and 405B (Meta's shapes, 8,192 positions as pretrained before the long-context stage).
    "llama3_70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128_256,
                       ffn_dim=28_672, max_seq_len=8192, rope_theta=500_000.0),
    "llama3_405b": dict(dim=16_384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128_256,
                        ffn_dim=53_248, max_seq_len=8192, rope_theta=500_000.0),
    # Mixtures of experts of the field's shape: fine-grained routed experts, shared experts, the first layer dense.
    # DeepSeek-V2-Lite's sizes (15.8B total, 2.7B active here; grouped-query attention in place of its MLA):
    "moe_16b": dict(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102_400, ffn_dim=10_944,
                    max_seq_len=4096, n_experts=64, experts_per_token=6, expert_ffn_dim=1408, n_shared_experts=2,
                    moe_first_dense=1, moe_score="softmax"),
    # Qwen3-30B-A3B's sizes (30.1B total, 2.9B active here; head_dim 64 where Qwen3 widens the heads to 128):
    "moe_30b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, vocab_size=151_936, ffn_dim=6144,
                    max_seq_len=4096, rope_theta=1_000_000.0, n_experts=128, experts_per_token=8,
                    expert_ffn_dim=768, moe_score="softmax"),
    # The small CPU shape of benchmarks/moe_bench.py (dim 64, 2 layers, dense ffn_dim 256) as a fine-grained MoE at the
    # dense model's active width ((7 + 1) x 32 = 256): 64 experts top-7 of 32 and 1 shared, the arm that reached the
    # dense loss in the fewest tokens there (docs/moe.md#fine-grained-experts; train it at optim.lr 6e-3).
    "moe_small": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=1024, ffn_dim=256, max_seq_len=512,
                      n_experts=64, experts_per_token=7, expert_ffn_dim=32, n_shared_experts=1),
}

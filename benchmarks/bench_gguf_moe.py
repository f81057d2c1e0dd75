"""Mixture-of-experts layers: lowbit.GGUFExperts (three ggml_mul_mat_id
calls), in the file's layout and repacked (GGUFExperts.repack), against llama.cpp's ggml_mul_mat_id on the same blocks (the CPU
backend of llama-cpp-python, tests/llama_cpp_peer.py: gate, up and down, each one
call, as llama.cpp's build_moe_ffn issues them; the activation between them
is not timed on its side) and transformers' own eager experts module
(Qwen3MoeExperts) holding fp32 weights, which is what a model dequantized at
load runs.

Shapes: a layer of Qwen3-30B-A3B (128 experts of 2048 -> 768, 8 per token)
and of Mixtral-8x7B (8 experts of 4096 -> 14336, 2 per token), in the types
of their Q4_K_M files (gate and up Q4_K, down Q6_K), and of gpt-oss-20b (32
experts of 2880 -> 2880, 4 per token) in MXFP4, as its files hold its
experts (its biases and clamped SwiGLU are not timed: the peer's calls and
the HF column are the three products alone), for 1 token (decode), 4 and 32. Each timed call runs ROUTINGS different random routings one after
another, as consecutive tokens route: the chosen experts' weights then come
from memory, not cache (Qwen3: 16 routings of 8 experts reach about 100 of
128; Mixtral's two experts of 8 are re-read, 0.4 GB each, more than L3).
GB/s: the chosen experts' weight bytes over the time, against the machine's
copy bandwidth measured in the same run.

    python -m benchmarks.bench_gguf_moe          results: benchmarks/results/<machine>-gguf-moe.{txt,json}
    python -m benchmarks.bench_gguf_moe --layers gpt-oss-20b
                                                 results: ...<machine>-gguf-moe-gpt-oss-20b.{txt,json}
    python -m benchmarks.bench_gguf_moe --isa avx2   lowbit's AVX2 kernels: ...<machine>-avx2-gguf-moe*;
        the peer is llama-cpp-python's ggml unless LOWBIT_GGML_LIB_DIR names one built for AVX2
        (benchmarks/README.md)
"""
import argparse
import copy
import os

import numpy as np
import torch

import lowbit
from benchmarks.common import (CopyBandwidth, add_isa_argument, force_isa, machine, openmp_header, print_table,
                               printed_to, results_dir, time_rounds_ms, write_results)
from tests import gguf_blocks as gb
from tests import llama_cpp_peer

Q4_K_M = {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}
MXFP4 = dict.fromkeys(("gate", "up", "down"), "MXFP4")
# name: (experts, hidden, intermediate, experts per token, each projection's type)
LAYERS = {"Qwen3-30B-A3B": (128, 2048, 768, 8, Q4_K_M), "Mixtral-8x7B": (8, 4096, 14336, 2, Q4_K_M),
          "gpt-oss-20b": (32, 2880, 2880, 4, MXFP4)}
TOKENS = [1, 4, 32]
THREADS = [1, 2]
ROUTINGS = 16


def layer(rng, experts, hidden, intermediate, types):
    """Random blocks of each projection, [experts * rows, row_bytes], and the module over them."""
    shapes = {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
    blocks = {p: torch.from_numpy(gb.random_blocks(rng, types[p], experts * r, n)) for p, (r, n) in shapes.items()}
    module = lowbit.GGUFExperts(*((blocks[p], gb.type_id(types[p])) for p in ("gate", "up", "down")),
                                experts=experts, hidden_size=hidden, intermediate_size=intermediate,
                                act_fn=torch.nn.SiLU())
    return blocks, module


def float_experts(module):
    """transformers' Qwen3MoeExperts holding the module's dequantized weights in fp32."""
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=module.hidden_size, moe_intermediate_size=module.intermediate_size,
                                         num_experts=module.num_experts)
    config._experts_implementation = "eager"  # its loop over experts, standalone
    hf = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    w = module.dequantize()
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.cat([w["gate"], w["up"]], dim=1))
        hf.down_proj.copy_(w["down"])
    return hf


def routings(rng, tokens, experts, k):
    """ROUTINGS routings: (ids [tokens, k] int32, weights [tokens, k])."""
    out = []
    for _ in range(ROUTINGS):
        ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
        w = rng.random((tokens, k)).astype(np.float32)
        out.append((torch.from_numpy(ids), torch.from_numpy(w / w.sum(1, keepdims=True))))
    return out


def chosen_bytes(blocks, experts, route):
    per_expert = sum(b.numel() for b in blocks.values()) / experts
    return sum(len(np.unique(ids.numpy())) for ids, _ in route) * per_expert


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Qwen3's layer only, 1 thread, shorter timing")
    parser.add_argument("--layers", help=f"comma-separated subset of {', '.join(LAYERS)} (results named after it)")
    add_isa_argument(parser)
    args = parser.parse_args()
    force_isa(parser, args.isa)
    names = args.layers.split(",") if args.layers else list(LAYERS)[:1 if args.quick else None]
    unknown = [n for n in names if n not in LAYERS]
    if unknown:
        parser.error(f"unknown layers {unknown}; choose from {', '.join(LAYERS)}")
    suffix = "" if not args.layers else "-" + "-".join(n.lower() for n in names)

    info = machine()
    stem = f"{info['slug']}-{args.isa}-gguf-moe{suffix}" if args.isa else f"{info['slug']}-gguf-moe{suffix}"
    stem = os.path.join(results_dir(args.quick), stem)
    threads = [1] if args.quick else [t for t in THREADS if t <= torch.get_num_threads()]
    budget = 0.1 if args.quick else 0.3
    peer_missing = llama_cpp_peer.available()
    rng = np.random.default_rng(0)
    records = []
    with printed_to(f"{stem}.txt"):
        bandwidth = CopyBandwidth(threads=threads)
        print(f"machine: {info['name']} ({info['threads']} threads), torch {info['torch']}, "
              f"CPU kernels: {torch.ops.lowbit.cpu_isa()}, {openmp_header()}")
        print(peer_missing or "llama.cpp peer: ggml_mul_mat_id of "
              + (f"the libggml in LOWBIT_GGML_LIB_DIR={os.environ['LOWBIT_GGML_LIB_DIR']}"
                 if os.environ.get("LOWBIT_GGML_LIB_DIR") else "llama-cpp-python's libggml"))
        for name in names:
            experts, hidden, intermediate, k, types = LAYERS[name]
            torch.set_num_threads(max(threads))
            bandwidth.sample()
            blocks, module = layer(rng, experts, hidden, intermediate, types)
            hf = float_experts(module)
            packed = copy.deepcopy(module)
            packed.repack()
            for tokens in TOKENS:
                route = routings(rng, tokens, experts, k)
                x = torch.randn(tokens, hidden)
                h = torch.randn(tokens, k, intermediate)
                peers = None
                if not peer_missing:
                    peers = [llama_cpp_peer.GgmlMulMatId(blocks[p].numpy(), gb.type_id(types[p]), experts, rows, n, tokens,
                                                    k, 1, per_slot=p == "down")
                             for p, (rows, n) in (("gate", (intermediate, hidden)), ("up", (intermediate, hidden)),
                                                  ("down", (hidden, intermediate)))]

                def ours(m):
                    return lambda: [m(x, ids, w) for ids, w in route]

                def theirs():
                    for ids, _ in route:
                        for peer, xin in zip(peers, (x, x, h)):
                            peer.set_input(xin.numpy(), ids.numpy())
                            peer.compute()

                def dense():
                    for ids, w in route:
                        hf(x, ids.long(), w)

                for t in threads:
                    torch.set_num_threads(t)
                    for peer in peers or []:
                        peer.threads = t
                    with torch.no_grad():
                        ms, packed_ms, peer_ms, dense_ms = (v / ROUTINGS for v in time_rounds_ms(
                            [ours(module), ours(packed), peers and theirs, dense], min_reps=2, budget_s=budget))
                    gbs = chosen_bytes(blocks, experts, route) / ROUTINGS / (packed_ms * 1e-3) / 1e9
                    records.append(dict(layer=name, experts=experts, hidden=hidden, intermediate=intermediate,
                                        experts_per_token=k, types=types, tokens=tokens, threads=t, lowbit_ms=ms,
                                        repacked_ms=packed_ms, repacked_projections=packed.repack(),
                                        llama_cpp_ms=peer_ms, speedup_vs_llama_cpp=peer_ms / ms,
                                        repacked_speedup_vs_llama_cpp=peer_ms / packed_ms,
                                        transformers_fp32_ms=dense_ms, speedup_vs_transformers_fp32=dense_ms / ms,
                                        repacked_weight_gbs=gbs))
                del peers
            del blocks, module, packed, hf
        torch.set_num_threads(max(threads))
        bandwidth.sample()
        print(bandwidth.describe() + "\n")
        print(f"ms per layer call (each the mean over {ROUTINGS} routings); lowbit in the file's layout and "
              f"repacked; GB/s: the chosen experts' weight bytes / the repacked time")
        rows = []
        for r in records:
            of = r["repacked_weight_gbs"] / bandwidth.gbs_at(r["threads"])
            rows.append([r["layer"], r["tokens"], r["threads"], f"{r['lowbit_ms']:.3f}", f"{r['repacked_ms']:.3f}",
                         f"{r['llama_cpp_ms']:.3f}", f"{r['speedup_vs_llama_cpp']:.2f}x",
                         f"{r['repacked_speedup_vs_llama_cpp']:.2f}x", f"{r['transformers_fp32_ms']:.3f}",
                         f"{r['speedup_vs_transformers_fp32']:.2f}x", f"{r['repacked_weight_gbs']:.1f}", f"{of:.0%}"])
        print_table(["layer", "tokens", "thr", "file ms", "repacked ms", "llama.cpp ms", "file vs it", "repacked vs it",
                     "HF fp32 ms", "file vs it", "GB/s", "of thr bw"], rows)
    write_results(f"{stem}.json", dict(machine=info, cpu_isa=torch.ops.lowbit.cpu_isa(),
                                                                routings_per_call=ROUTINGS,
                                                                **bandwidth.as_record(), moe=records))


if __name__ == "__main__":
    main()

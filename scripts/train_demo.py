#!/usr/bin/env python
"""Train the bundled demo: a ~7.2M-parameter Qwen3-MoE with a byte-level tokenizer, and three PEFT
LoRA adapters (upper, reverse, rot13), then evaluate the SAVED artifacts with moelora and with
transformers + PEFT and write MODEL_CARD.md and train_metrics.json next to them.

    # everything, into moelora/demo/assets
    python scripts/train_demo.py
    # smoke test of every stage (accuracies ~0)
    python scripts/train_demo.py --base-steps 30 --adapter-steps 10 --out /tmp/demo_smoke --device cpu

Run time, one H200 (torch 2.11, bf16 autocast), measured with shorter runs of this script: ~40 ms per
base step, ~50 ms per adapter step, ~30 s of evaluation, so the defaults (4000 base steps, 1500 per
adapter) take about 7 minutes: base ~2.7 min, each adapter ~1.3 min, evaluation ~0.5 min. On a 2-core
CPU a base step of batch 256 takes ~3 s (~70x slower; more when the cores are shared): the full run is
a GPU job. The smoke test above took 3.6 minutes on an idle 2-core CPU (base 83 s, adapters ~24 s each,
evaluation 56 s) and 7.8 minutes on a busy one.

Task format (see moelora/demo/__init__.py): prompt = input + " => ", completion = transformed input + "\\n";
"\\n" (byte 10) is an EOS id in generation_config.json, so generation stops there.

Stages (--stages, comma-separated; each reads what it needs from disk, so a run can be split over
several commands that share --out and --work):
  base     pre-train the base on five formats: echo, upper, reverse, rot13 each behind a task-prefix
           token (<|echo|>, <|upper|>, ...) that demo prompts never contain, plus the prefix-free echo
           (twice as often); saved in bfloat16 (save_pretrained, safetensors) with the tokenizer.
  upper    LoRA r=8 on the prefix-free format, trained against the saved (bf16-rounded) base;
           saved as PEFT saves it (target_parameters layout for the experts).
  reverse  LoRA r=8, saved by PEFT to <work>/reverse_peft and converted to the per-expert 2-D layout
           with moelora.adapters.convert.target_parameters_to_per_expert.
  rot13    LoRA r=16.
  eval     exact match on 200 unseen random inputs per adapter (and the base): moelora LLM.generate on
           one mixed-adapter batch, and transformers + PEFT greedy; writes the model card and metrics.

Reproducibility: every random choice comes from --seed (data: random.Random per stage; weights:
torch.manual_seed per stage). CPU runs repeat bit for bit; GPU runs (bf16 autocast, non-deterministic
kernels) repeat up to rounding. The evaluation inputs are drawn first and excluded from all training data.

Needs only torch, transformers, peft, safetensors, tokenizers and moelora (no network, no tqdm).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout too

from moelora.demo import ADAPTERS, MAX_LEN, TRANSFORMS, assets_path, make_prompt, random_input  # noqa: E402

# ---- vocabulary: ids 0..255 are the bytes, then the special tokens ----------------------------------------
EOS, PAD = "<|endoftext|>", "<|pad|>"
TASK_TOKENS = {None: "<|echo|>", "upper": "<|upper|>", "reverse": "<|reverse|>", "rot13": "<|rot13|>"}
SPECIALS = [EOS, PAD, *TASK_TOKENS.values()]
SPECIAL_IDS = {tok: 256 + i for i, tok in enumerate(SPECIALS)}
EOS_ID, PAD_ID = SPECIAL_IDS[EOS], SPECIAL_IDS[PAD]
NEWLINE_ID = ord("\n")
TASK_IDS = {task: SPECIAL_IDS[tok] for task, tok in TASK_TOKENS.items()}
VOCAB_SIZE = 256 + len(SPECIALS)  # 262

MODEL_KW = dict(
    vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=32, intermediate_size=512, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=True,
    max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
    initializer_range=0.02, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    attention_bias=False, output_router_logits=False,
)
ATTN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
RANKS = {"upper": 8, "reverse": 8, "rot13": 16}
# base pre-training mix: (task, with task prefix); the prefix-free echo comes twice as often
BASE_FORMATS = [(None, False), (None, False), (None, True), ("upper", True), ("reverse", True), ("rot13", True)]
MAX_NEW_TOKENS = MAX_LEN + 8
SIZE_LIMIT = 20_000_000  # bytes: model + adapters
ALL_STAGES = ["base", *ADAPTERS, "eval"]


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- data -----------------------------------------------------------------------------------------------
def eval_inputs(seed: int, n: int) -> list[str]:
    """n distinct inputs, drawn before any training data and excluded from it (so they are unseen)."""
    rng = random.Random(f"demo-eval-{seed}")
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        s = random_input(rng)
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def encode(task: str | None, text: str, prefixed: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of one example; the completion ends with the newline EOS."""
    prompt = ([TASK_IDS[task]] if prefixed else []) + list(make_prompt(text).encode())
    completion = list((TRANSFORMS[task](text) + "\n").encode())
    return prompt, completion


class Batches:
    """Random training batches: inputs [B, T] and next-token labels [B, T] (-100 outside completions)."""

    def __init__(self, formats, batch_size: int, seed: str, exclude: set[str], device: torch.device) -> None:
        self.formats, self.batch_size, self.exclude, self.device = formats, batch_size, exclude, device
        self.rng = random.Random(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = []
        for _ in range(self.batch_size):
            text = random_input(self.rng)
            while text in self.exclude:
                text = random_input(self.rng)
            task, prefixed = self.rng.choice(self.formats)
            seqs.append(encode(task, text, prefixed))
        T = max(len(p) + len(c) for p, c in seqs) - 1
        xs, ys = [], []  # flat lists: one tensor conversion each
        for p, c in seqs:  # right-padded; position t predicts token t + 1
            pad = T - (len(p) + len(c) - 1)
            xs += p + c[:-1] + [PAD_ID] * pad
            ys += [-100] * (len(p) - 1) + c + [-100] * pad
        x = torch.tensor(xs, dtype=torch.long).view(len(seqs), T)
        y = torch.tensor(ys, dtype=torch.long).view(len(seqs), T)
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y


# ---- training -------------------------------------------------------------------------------------------
def train_loop(model, params, batches: Batches, steps: int, lr: float, weight_decay: float, device: torch.device,
               log_every: int, name: str, aux_coef: float = 0.0) -> dict:
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                            fused=device.type == "cuda")
    if steps >= 10:  # one-cycle: 10% warm-up (at least 2 steps), cosine decay
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=max(0.1, 2 / steps),
                                                    anneal_strategy="cos", div_factor=25.0, final_div_factor=1e3)
    else:  # too few steps for a cycle (smoke tests): constant lr
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    use_bf16 = device.type == "cuda"
    model.train()
    t0 = time.perf_counter()
    history = []
    for step in range(1, steps + 1):
        x, y = batches.next()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            out = model(input_ids=x, use_cache=False, output_router_logits=aux_coef > 0)
        logits = out.logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        total = loss + aux_coef * out.aux_loss.float() if aux_coef > 0 else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps or step == 1:
            with torch.no_grad():  # teacher-forced whole-completion accuracy of this batch
                ok = ((logits.argmax(-1) == y) | (y == -100)).all(-1).float().mean().item()
            el = time.perf_counter() - t0
            rec = {"step": step, "loss": round(loss.item(), 5), "seq_acc": round(ok, 4),
                   "lr": sched.get_last_lr()[0], "elapsed_s": round(el, 1)}
            history.append(rec)
            eta = el / step * (steps - step)
            log(f"[{name}] step {step:5d}/{steps}  loss {loss.item():.4f}  batch seq-acc {ok:6.1%}  "
                f"lr {rec['lr']:.2e}  elapsed {el:6.1f}s  eta {eta:6.1f}s")
    if device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    model.eval()
    return {"steps": steps, "batch_size": batches.batch_size, "lr": lr, "seconds": round(secs, 1),
            "final_loss": history[-1]["loss"] if history else None,
            "final_batch_seq_acc": history[-1]["seq_acc"] if history else None, "history": history}


# chat: the last message's content is the input, the generation prompt the task's " => "
CHAT_TEMPLATE = "{{ messages[-1]['content'] }}{% if add_generation_prompt %} => {% endif %}"


def save_tokenizer(path: str) -> None:
    """Byte-level tokenizer without merges: bytes 0..255 are ids 0..255, then SPECIALS from 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    byte_to_char = _bytes_to_unicode()
    assert sorted(byte_to_char.values()) == sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
                   "additional_special_tokens": list(TASK_TOKENS.values()), "model_max_length": 256,
                   "padding_side": "left", "clean_up_tokenization_spaces": False,
                   "chat_template": CHAT_TEMPLATE}, f, indent=2)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def check_tokenizer(path: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    sample = make_prompt("hello world") + "HELLO WORLD\n"
    assert tok.encode(sample, add_special_tokens=False) == list(sample.encode()), "tokenizer is not byte-identity"
    assert tok.encode("<|upper|>ab", add_special_tokens=False) == [TASK_IDS["upper"], 97, 98]
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == PAD_ID and len(tok) == VOCAB_SIZE
    assert tok.decode(list(sample.encode())) == sample


def stage_base(args, device, exclude, metrics) -> None:
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL_KW)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[base] Qwen3-MoE with {n_params:,} parameters on {device}; {args.base_steps} steps of {args.batch_size}")
    batches = Batches(BASE_FORMATS, args.batch_size, f"demo-base-{args.seed}", exclude, device)
    res = train_loop(model, model.parameters(), batches, args.base_steps, args.lr, 0.01, device, args.log_every,
                     "base", aux_coef=args.router_aux_coef)
    res.update(params=n_params, router_aux_coef=args.router_aux_coef, weight_decay=0.01,
               formats=[f"{'<|' + (t or 'echo') + '|> ' if p else ''}{t or 'echo'}" for t, p in BASE_FORMATS])
    metrics["stages"]["base"] = res
    path = os.path.join(args.out, "model")
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=[EOS_ID, NEWLINE_ID],
                                               pad_token_id=PAD_ID, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    model.to(torch.bfloat16).save_pretrained(path)
    save_tokenizer(path)
    check_tokenizer(path)
    log(f"[base] saved to {path} (bfloat16) in {res['seconds']} s of training")


def load_base(args, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(args.out, "model"), dtype=dtype)


def stage_adapter(args, device, exclude, metrics, name: str) -> None:
    from peft import LoraConfig, get_peft_model

    from moelora.adapters.convert import target_parameters_to_per_expert

    r = RANKS[name]
    torch.manual_seed(args.seed + 1 + ADAPTERS.index(name))
    base = load_base(args).to(device)  # the saved (bf16-rounded) weights, in fp32: what serving will see
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                        target_modules=ATTN_TARGETS, target_parameters=EXPERT_TARGETS)
    model = get_peft_model(base, config)
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"[{name}] LoRA r={r} alpha={2 * r}: {n_lora:,} trainable parameters; {args.adapter_steps} steps")
    batches = Batches([(name, False)], args.batch_size, f"demo-{name}-{args.seed}", exclude, device)
    res = train_loop(model, model.parameters(), batches, args.adapter_steps, args.adapter_lr, 0.0, device,
                     args.log_every, name)
    res.update(rank=r, lora_alpha=2 * r, lora_params=n_lora, saved_dtype=args.adapter_dtype)
    model.to(getattr(torch, args.adapter_dtype))  # PEFT saves the LoRA tensors in their dtype
    # name the base by its place beside the adapter folders, not by this machine's path
    model.peft_config["default"].base_model_name_or_path = "../model"
    model.get_base_model().config._name_or_path = "../model"  # PEFT's README.md
    dst = os.path.join(args.out, name)
    if name == "reverse":
        src = os.path.join(args.work, "reverse_peft")
        model.save_pretrained(src, save_embedding_layers=False)
        target_parameters_to_per_expert(src, dst, os.path.join(args.out, "model"))
        res["layout"] = "per-expert 2-D (converted with moelora.adapters.convert from the PEFT save)"
    else:
        model.save_pretrained(dst, save_embedding_layers=False)
        res["layout"] = "PEFT target_parameters (as PEFT saved it)"
    metrics["stages"][name] = res
    log(f"[{name}] saved to {dst} ({res['layout']})")


# ---- evaluation -----------------------------------------------------------------------------------------
def eval_moelora(args, device, inputs: list[str]) -> tuple[dict, dict]:
    """All adapters and the base in ONE mixed batch: every input once per adapter, interleaved.
    Returns ({adapter: [(text, stopped at EOS)] per input}, stats)."""
    from moelora import LLM, SamplingParams

    adapters = {name: os.path.join(args.out, name) for name in ADAPTERS}
    llm = LLM(model=os.path.join(args.out, "model"), adapters=adapters, max_loras=8, max_lora_rank=64,
              dtype="float32", device=device.type)
    names = [None, *ADAPTERS]
    rows = [(text, name) for text in inputs for name in names]
    t0 = time.perf_counter()
    outs = llm.generate([make_prompt(t) for t, _ in rows], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0),
                        adapter=[n for _, n in rows])
    secs = time.perf_counter() - t0
    got: dict = {n or "base": [] for n in names}
    for (_, name), out in zip(rows, outs):
        got[name or "base"].append((out.text, out.finish_reason == "stop"))
    n_tok = sum(len(o.token_ids) for o in outs)
    return got, {"requests": len(rows), "generated_tokens": n_tok, "seconds": round(secs, 2),
                 "tokens_per_s": round(n_tok / secs, 1)}


def hf_greedy(model, tok, prompts: list[str], device, batch: int = 256) -> list[tuple[str, bool]]:
    """transformers greedy generation: (text before the first EOS, whether an EOS came)."""
    res = []
    for i in range(0, len(prompts), batch):
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            seqs = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                  eos_token_id=[EOS_ID, NEWLINE_ID], pad_token_id=PAD_ID)
        for row in seqs[:, enc["input_ids"].shape[1] :].tolist():
            stop = next((j for j, t in enumerate(row) if t in (EOS_ID, NEWLINE_ID)), None)
            res.append((tok.decode(row[:stop], skip_special_tokens=True, clean_up_tokenization_spaces=False),
                        stop is not None))
    return res


def eval_peft(args, device, inputs: list[str]) -> tuple[dict, dict, dict]:
    """transformers (+ PEFT, one adapter at a time) greedy on the saved folders; the base also with its
    pre-training task prefixes. Returns (outputs per adapter, outputs per prefixed task, notes)."""
    import copy

    from peft import PeftModel
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(args.out, "model"), local_files_only=True)
    tok.padding_side = "left"
    base = load_base(args).to(device).eval()
    plain = [make_prompt(t) for t in inputs]
    got = {"base": hf_greedy(base, tok, plain, device)}
    prefixed = {(task or "echo"): hf_greedy(base, tok, [s + p for p in plain], device)
                for task, s in TASK_TOKENS.items()}
    notes = {}
    for name in ADAPTERS:
        path = os.path.join(args.out, name)
        if name == "reverse":  # transformers 5 fuses the experts: PEFT reads the layout PEFT wrote
            path = os.path.join(args.work, "reverse_peft")
            notes[name] = ("transformers+PEFT ran the pre-conversion PEFT save (the same weights in the "
                           "target_parameters layout); moelora ran the converted per-expert folder")
            if not os.path.isdir(path):
                notes[name] = f"transformers+PEFT skipped: {path} is missing (run the reverse stage with this --work)"
                continue
        model = PeftModel.from_pretrained(copy.deepcopy(base), path).to(device).eval()
        got[name] = hf_greedy(model, tok, plain, device)
        del model
    return got, prefixed, notes


def exact_match(task: str | None, inputs: list[str], outs: list[tuple[str, bool]]) -> float:
    """Output text equals the transform and generation stopped at an EOS (the newline)."""
    return sum(text == TRANSFORMS[task](x) and stopped for x, (text, stopped) in zip(inputs, outs)) / len(inputs)


def expert_usage(args, device, inputs: list[str]) -> list[list[float]]:
    """Fraction of routed (token, k) slots per expert and layer, base model on the evaluation prompts."""
    base = load_base(args).to(device).eval()
    counts = torch.zeros(MODEL_KW["num_hidden_layers"], MODEL_KW["num_experts"])
    with torch.no_grad():
        for text in inputs:
            ids = torch.tensor([list(make_prompt(text).encode())], device=device)
            out = base(input_ids=ids, output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                top = logits.float().topk(MODEL_KW["num_experts_per_tok"], -1).indices.flatten().cpu()
                counts[layer] += torch.bincount(top, minlength=MODEL_KW["num_experts"]).float()
    return (counts / counts.sum(-1, keepdim=True)).round(decimals=3).tolist()


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def stage_eval(args, device, inputs: list[str], metrics) -> bool:
    t0 = time.perf_counter()
    task_of = {(n or "base"): n for n in [None, *ADAPTERS]}
    log(f"[eval] moelora LLM.generate: one mixed batch of {len(inputs)} inputs x {len(task_of)} adapters")
    ml_out, ml_stats = eval_moelora(args, device, inputs)
    ml_acc = {k: exact_match(task_of[k], inputs, v) for k, v in ml_out.items()}
    log(f"[eval] moelora:           {fmt_acc(ml_acc)}  ({ml_stats['tokens_per_s']} generated tok/s)")
    log("[eval] transformers + PEFT greedy, one adapter at a time")
    pe_out, pre_out, notes = eval_peft(args, device, inputs)
    pe_acc = {k: exact_match(task_of[k], inputs, v) for k, v in pe_out.items()}
    pre_acc = {k: exact_match(None if k == "echo" else k, inputs, v) for k, v in pre_out.items()}
    # same greedy text from both stacks: checks loading, the layout conversion and the mixed batch, even
    # for an untrained model (fp32 argmax ties aside)
    agree = {k: sum(a == b for a, b in zip(ml_out[k], v)) / len(inputs) for k, v in pe_out.items()}
    log(f"[eval] transformers+PEFT: {fmt_acc(pe_acc)}")
    log(f"[eval] moelora == transformers+PEFT output: {fmt_acc(agree)}")
    log(f"[eval] base with task prefixes (transformers): {fmt_acc(pre_acc)}")
    failures = {}
    for k, outs in ml_out.items():
        bad = [{"input": x, "output": t, "stopped": s, "expected": TRANSFORMS[task_of[k]](x)}
               for x, (t, s) in zip(inputs, outs) if not (t == TRANSFORMS[task_of[k]](x) and s)]
        if bad:
            failures[k] = bad[:5]
    usage = expert_usage(args, device, inputs)
    sizes = {k: folder_bytes(os.path.join(args.out, k)) for k in ["model", *ADAPTERS]}
    total = sum(sizes.values())
    metrics["eval"] = {
        "n": len(inputs), "inputs_seed": f"demo-eval-{args.seed}", "examples": inputs[:5],
        "moelora": {"accuracy": ml_acc, **ml_stats, "failures": failures},
        "transformers_peft": {"accuracy": pe_acc, "notes": notes},
        "moelora_equals_transformers_peft": agree,
        "base_with_task_prefix": pre_acc,
        "expert_usage_per_layer": usage, "seconds": round(time.perf_counter() - t0, 1),
    }
    metrics["sizes_bytes"] = {**sizes, "total": total, "limit": SIZE_LIMIT}
    log("[eval] artifact sizes: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items())
        + f"; total {total / 1e6:.2f} MB (limit {SIZE_LIMIT / 1e6:.0f} MB)")
    if total > SIZE_LIMIT:
        log("[eval] ERROR: the artifacts exceed the size limit")
    return total <= SIZE_LIMIT


def fmt_acc(acc: dict) -> str:
    return "  ".join(f"{k} {v:.1%}" for k, v in acc.items())


# ---- model card -----------------------------------------------------------------------------------------
def write_card(args, metrics) -> None:
    st, ev, env = metrics["stages"], metrics.get("eval", {}), metrics["env"]
    base = st.get("base", {})
    ml = ev.get("moelora", {}).get("accuracy", {})
    pe = ev.get("transformers_peft", {})
    pacc = pe.get("accuracy", {})
    sizes = metrics.get("sizes_bytes", {})
    k = MODEL_KW
    lines = [
        "# moelora demo model",
        "",
        "A tiny Mixture-of-Experts language model with three LoRA adapters that do visibly different things,",
        "bundled with moelora so that a mixed-adapter batch that leaks weights between rows shows it in plain",
        "text (`python -m moelora.demo.run`). Written by `scripts/train_demo.py`; do not edit by hand.",
        "",
        "## Task",
        "",
        "Prompt: `<input> => `; completion: the transformed input followed by `\\n` (byte 10), which is an EOS id",
        "in `generation_config.json` together with `<|endoftext|>`. Inputs: lowercase ASCII words separated by",
        "single spaces, 3 to 24 characters (`moelora.demo.random_input`).",
        "",
        "| adapter | output | example |",
        "|---|---|---|",
    ]
    for name in [None, *ADAPTERS]:
        what = {None: "the input unchanged (echo)", "upper": "upper case", "reverse": "reversed character by character",
                "rot13": "ROT13 on letters"}[name]
        lines.append(f"| {name or '(none: base)'} | {what} | `hello world => {TRANSFORMS[name]('hello world')}` |")
    lines += [
        "",
        "## Architecture",
        "",
        f"`Qwen3MoeForCausalLM` (transformers format, safetensors, bfloat16 weights): {base.get('params', 0):,} "
        "parameters.",
        f"hidden {k['hidden_size']}, {k['num_hidden_layers']} layers, {k['num_attention_heads']} attention heads / "
        f"{k['num_key_value_heads']} KV heads of head_dim {k['head_dim']} (q/k RMSNorm), every layer a sparse MoE of "
        f"{k['num_experts']} routed experts (SwiGLU, moe_intermediate {k['moe_intermediate_size']}), top-"
        f"{k['num_experts_per_tok']}, norm_topk_prob {k['norm_topk_prob']}, tied embeddings, RoPE theta "
        f"{k['rope_theta']:g}, max_position_embeddings {k['max_position_embeddings']}.",
        "",
        "Tokenizer: byte level (`tokenizer.json`), ids 0..255 are the bytes, then "
        + ", ".join(f"`{s}` {SPECIAL_IDS[s]}" for s in SPECIALS) + f"; vocab {VOCAB_SIZE}.",
        "",
        "## Training",
        "",
        f"Base: {base.get('steps', '?')} steps of batch {base.get('batch_size', '?')}, AdamW (betas 0.9/0.95, weight "
        f"decay 0.01), one-cycle lr (max {base.get('lr', '?')}, 10% warm-up, cosine), grad clip 1.0, router "
        f"load-balancing loss x{base.get('router_aux_coef', '?')}, bf16 autocast on GPU (fp32 on CPU); loss on "
        "completion tokens only. Mix of five formats: echo, upper, reverse and rot13, each behind a task-prefix "
        "token (`<|echo|>`, `<|upper|>`, ...) that demo prompts never contain, plus the prefix-free echo "
        "(twice as often), so the base knows every transform but echoes without a prefix.",
        "",
        "Adapters: PEFT `LoraConfig(r, lora_alpha=2r, lora_dropout=0, target_modules=[q_proj, k_proj, v_proj, "
        "o_proj], target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj])`, trained on the prefix-free "
        "format against the saved (bfloat16-rounded) base, AdamW (no weight decay), one-cycle lr.",
        "",
        "| part | rank | steps x batch | train time | final loss | layout on disk | size |",
        "|---|---|---|---|---|---|---|",
        f"| model | - | {base.get('steps', '?')} x {base.get('batch_size', '?')} | {base.get('seconds', '?')} s | "
        f"{base.get('final_loss', '?')} | transformers, bfloat16 | {sizes.get('model', 0) / 1e6:.2f} MB |",
    ]
    for name in ADAPTERS:
        s = st.get(name, {})
        lines.append(f"| {name} | {s.get('rank', '?')} | {s.get('steps', '?')} x {s.get('batch_size', '?')} | "
                     f"{s.get('seconds', '?')} s | {s.get('final_loss', '?')} | {s.get('layout', '?')}, "
                     f"{s.get('saved_dtype', '?')} | {sizes.get(name, 0) / 1e6:.2f} MB |")
    lines += [
        "",
        f"Total size of model + adapters: {sizes.get('total', 0) / 1e6:.2f} MB (limit 20 MB).",
        "",
        f"Run: `{metrics['command']}`  ",
        f"Device: {env['device_name']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"peft {env['peft']}, python {env['python']}.  ",
        f"Seed {args.seed} (data: `random.Random(\"demo-<stage>-{args.seed}\")`, weights: `torch.manual_seed`); "
        f"total wall time {metrics.get('total_seconds', '?')} s.",
        "",
        "## Measured accuracy",
        "",
        f"Exact match (output text equals the transform and generation stopped at the newline) on "
        f"{ev.get('n', '?')} random inputs never seen in training (drawn first from "
        f"`random.Random(\"{ev.get('inputs_seed', '?')}\")` and excluded from all training data), greedy, "
        "evaluated on the saved artifacts reloaded from disk, fp32 compute. The last column: share of rows where "
        "both stacks generated the same text.",
        "",
        "| adapter | moelora `LLM.generate` (one mixed batch) | transformers + PEFT | same output |",
        "|---|---|---|---|",
    ]
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    agree = ev.get("moelora_equals_transformers_peft", {})
    for name in ["base", *ADAPTERS]:
        lines.append(f"| {name} | {pct(ml.get(name))} | {pct(pacc.get(name))} | {pct(agree.get(name))} |")
    tps = ev.get("moelora", {}).get("tokens_per_s")
    if tps:
        lines += ["", f"moelora generated {ev['moelora']['generated_tokens']} tokens for {ev['moelora']['requests']} "
                  f"requests in {ev['moelora']['seconds']} s ({tps} tokens/s, {env['device']}, fp32)."]
    bp = ev.get("base_with_task_prefix", {})
    if bp:
        lines += ["", "Base model with its pre-training task prefixes (transformers): "
                  + ", ".join(f"`<|{t}|>` {v:.1%}" for t, v in bp.items()) + "."]
    for name, note in pe.get("notes", {}).items():
        lines += ["", f"Note ({name}): {note}."]
    usage = ev.get("expert_usage_per_layer")
    if usage:
        lines += ["", "Share of routed slots per expert (base model, evaluation prompts), per layer: "]
        lines += [f"- layer {i}: " + " ".join(f"{u:.2f}" for u in row) for i, row in enumerate(usage)]
    lines += ["", "Raw numbers: `train_metrics.json`.", ""]
    with open(os.path.join(args.out, "MODEL_CARD.md"), "w") as f:
        f.write("\n".join(lines))


# ---- main -----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=assets_path(), help="output folder (default: moelora/demo/assets)")
    p.add_argument("--work", default=None,
                   help="scratch folder for the PEFT save of reverse (default: in the temp dir, named after --out)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="training and evaluation device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of all data and weight initialisation")
    p.add_argument("--base-steps", type=int, default=4000, help="base pre-training steps")
    p.add_argument("--adapter-steps", type=int, default=1500, help="training steps per adapter")
    p.add_argument("--batch-size", type=int, default=256, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="base peak learning rate")
    p.add_argument("--adapter-lr", type=float, default=2e-3, help="adapter peak learning rate")
    p.add_argument("--router-aux-coef", type=float, default=0.01, help="load-balancing loss weight (base)")
    p.add_argument("--adapter-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the saved LoRA tensors (float32 makes the total exceed 20 MB)")
    p.add_argument("--eval-n", type=int, default=200, help="unseen evaluation inputs (per adapter)")
    p.add_argument("--log-every", type=int, default=250, help="print progress every N steps")
    p.add_argument("--stages", default=",".join(ALL_STAGES), help=f"comma-separated subset of {ALL_STAGES}")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    tag = hashlib.sha1(args.out.encode()).hexdigest()[:10]
    args.work = os.path.abspath(args.work or os.path.join(tempfile.gettempdir(), f"train_demo-{tag}"))
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in args.stages if s not in ALL_STAGES]
    if bad:
        p.error(f"unknown stages {bad}; choose from {ALL_STAGES}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    metrics_file = os.path.join(args.out, "train_metrics.json")
    metrics = {"stages": {}}
    if os.path.isfile(metrics_file) and set(args.stages) != set(ALL_STAGES):  # a split run: keep earlier stages
        with open(metrics_file) as f:
            metrics = json.load(f)
    import peft
    import transformers

    transformers.utils.logging.disable_progress_bar()

    metrics["env"] = {
        "device": str(device), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
    }
    metrics["command"] = "python scripts/train_demo.py " + " ".join(sys.argv[1:] if argv is None else argv)
    metrics["seed"] = args.seed
    metrics["model_config"] = MODEL_KW
    metrics["stages_run_last"] = args.stages
    log(f"train_demo: stages {args.stages} -> {args.out} on {metrics['env']['device_name']} "
        f"(torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__})")
    inputs = eval_inputs(args.seed, args.eval_n)
    exclude = set(inputs)
    ok = True
    for stage in args.stages:
        t0 = time.perf_counter()
        if stage == "base":
            stage_base(args, device, exclude, metrics)
        elif stage in ADAPTERS:
            stage_adapter(args, device, exclude, metrics, stage)
        else:
            ok = stage_eval(args, device, inputs, metrics)
        metrics.setdefault("stage_wall_s", {})[stage] = round(time.perf_counter() - t0, 1)
        with open(metrics_file, "w") as f:
            json.dump(metrics, f, indent=2)
    metrics["total_seconds"] = round(sum(metrics.get("stage_wall_s", {}).values()), 1)
    with open(metrics_file, "w") as f:
        json.dump(metrics, f, indent=2)
    if "eval" in args.stages:
        write_card(args, metrics)
        ml = metrics["eval"]["moelora"]["accuracy"]
        pa = metrics["eval"]["transformers_peft"]["accuracy"]
        same = metrics["eval"]["moelora_equals_transformers_peft"]
        log(f"\nfinal exact match on {args.eval_n} unseen inputs (saved artifacts):")
        log(f"  {'adapter':8s} {'moelora':>8s} {'peft':>8s} {'same out':>9s}")
        for name in ["base", *ADAPTERS]:
            b, c = pa.get(name), same.get(name)
            pb, pc = "-" if b is None else f"{b:.1%}", "-" if c is None else f"{c:.1%}"
            log(f"  {name:8s} {ml[name]:8.1%} {pb:>8s} {pc:>9s}")
        log(f"model card: {os.path.join(args.out, 'MODEL_CARD.md')}")
    log(f"done in {time.perf_counter() - t_start:.1f} s; wrote {metrics_file}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

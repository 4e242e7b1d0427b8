"""bench.structured part micro, in process with no server: the grammar tokenizer's build, per schema the constraint's
build, a cold compile and a cached matcher, mask fills before every token of the instances, and one constrained
sequence's per-token path."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from bench.harness.report import progress, table
from bench.harness.servers import BenchmarkError
from bench.harness.stats import percentile
from bench.structured_schemas import SCHEMAS


@dataclass(frozen=True, slots=True, kw_only=True)
class Micro:
    """In process: the grammar tokenizer's build, per schema the constraint's build, a cold compile and a cached
    matcher (medians, ms), mask fills before every token of the instances, one constrained sequence's path (ms)."""

    vocab_size: int
    eos_tokens: list[int]
    tokenizer_build_s: float
    compiles: list[dict[str, Any]]
    fills: list[dict[str, Any]]
    step_ms: list[float]
    compiler_stats: dict[str, Any]

    @property
    def failed(self) -> bool:
        """A token of a valid instance refused, or end-of-sequence not allowed after one."""
        return any(fill["refused"] or fill["eos_refused"] for fill in self.fills)


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def median_ms(calls: Sequence[Callable[[], object]]) -> float:
    return statistics.median(timed(call) for call in calls) * 1000


def time_compiles(compiler: Any, tokens: dict[str, list[int]], repeats: int) -> list[dict[str, Any]]:
    from courier.grammar.compiler import GrammarCompiler
    from courier.grammar.constraint import json_schema

    rows = []
    for case in SCHEMAS:
        build = partial(json_schema, case.schema, name=case.name, param="response_format.json_schema.schema")
        constraint = build()
        figures = {"constraint_build_ms": median_ms([build] * repeats)}
        cold = [partial(GrammarCompiler(compiler.tokenizer).matcher, constraint) for _ in range(repeats)]
        figures["compile_cold_ms"] = median_ms(cold)
        compiler.matcher(constraint)  # now cached
        figures["matcher_cached_ms"] = median_ms([partial(compiler.matcher, constraint)] * repeats)
        grammar = {"schema": case.name, "grammar_bytes": len(constraint.grammar)}
        rows.append(grammar | figures | {"instance_tokens": len(tokens[case.name])})
    return rows


@dataclass(slots=True)
class Lane:
    """One sequence of the micro-benchmark's batch: going through the instances, a fresh matcher for each."""

    row: int
    order: list[int]  # indices into SCHEMAS, in the order this lane takes them
    instance: int = -1  # position in `order`
    position: int = 0  # next token of the current instance
    matcher: Any = None


def time_fills(
    compiler: Any, constraints: Sequence[Any], tokens: Sequence[list[int]], lanes: int, passes: int
) -> dict[str, Any]:
    """Fill masks before every token of every instance (and its end-of-sequence), `lanes` sequences at once, each
    `passes` times over the instances; stops when the first lane is done (the batch stays full)."""
    from courier.engine.constrained import MaskFiller

    streams = [[*instance, compiler.eos_tokens[0]] for instance in tokens]
    filler = MaskFiller(compiler.vocab_size, lanes)
    order = [[(lane + step) % len(streams) for step in range(len(streams))] * passes for lane in range(lanes)]
    batch = [Lane(row=filler.acquire(), order=each) for each in order]
    refused = eos_refused = fed = 0

    def next_instance(lane: Lane) -> bool:
        lane.instance, lane.position = lane.instance + 1, 0
        if lane.instance >= len(lane.order):
            return False
        lane.matcher = compiler.matcher(constraints[lane.order[lane.instance]])
        return True

    running = all(next_instance(lane) for lane in batch)
    filler.fill_seconds.clear()
    filler.fill_rows.clear()
    while running:
        for lane in batch:
            filler.due(lane.row, lane.matcher)
        for lane in batch:
            stream = streams[lane.order[lane.instance]]
            token, is_eos = stream[lane.position], lane.position == len(stream) - 1
            mask = filler.row(lane.row)  # None: not filled within the fill budget, so nothing allowed
            allowed = mask is not None and bool((int(mask[token // 32]) >> (token % 32)) & 1)
            eos_refused += is_eos and not allowed
            refused += not is_eos and not allowed
            fed, lane.position = fed + 1, lane.position + 1
            if is_eos or not allowed or not lane.matcher.consume_token(token):
                running = next_instance(lane) and running
    fills = list(filler.fill_seconds)
    per_token = [seconds / count for seconds, count in zip(fills, filler.fill_rows, strict=True)]
    return {
        **{"sequences": lanes, "fills": len(fills), "tokens": fed},
        **{f"fill_p{q}_ms": percentile(fills, q / 100) * 1000 for q in (50, 99)},
        "fill_mean_ms": statistics.fmean(fills) * 1000,
        **{f"per_token_p{q}_us": percentile(per_token, q / 100) * 1e6 for q in (50, 99)},
        **{"refused": refused, "eos_refused": eos_refused},
    }


def time_steps(loaded: Any, compiler: Any, constraints: Sequence[Any], tokens: Sequence[list[int]]) -> list[float]:
    """`ConstrainedSequence.process` + `.sample` before every token of every instance (and its end-of-sequence),
    one sequence, evaluated: the host-side cost a constrained sequence adds to each decode step (ms)."""
    import mlx.core as mx

    from courier.engine.constrained import ConstrainedSequence, MaskFiller

    logprobs = mx.random.normal((1, compiler.vocab_size))
    mx.eval(logprobs)
    milliseconds = []
    for constraint, instance in zip(constraints, tokens, strict=True):
        sequence = ConstrainedSequence(
            constraint,
            compiler=compiler,
            filler=MaskFiller(compiler.vocab_size, 1),
            decode=loaded.tokenizer.decode,
            prompt_length=0,
            sampler=lambda values: mx.argmax(values, axis=-1),
            eos_tokens=compiler.eos_tokens,
        )
        stream = [*instance, compiler.eos_tokens[0]]
        for position in range(len(stream)):
            context = mx.array(stream[:position], dtype=mx.int32)
            mx.eval(context)
            started = time.perf_counter()
            sequence.process(context, logprobs)
            mx.eval(sequence.sample(logprobs))
            milliseconds.append((time.perf_counter() - started) * 1000)
        sequence.release()
    return milliseconds


def measure_micro(loaded: Any, args: argparse.Namespace) -> Micro:
    from courier.grammar.compiler import DEFAULT_CAPACITY
    from courier.grammar.constraint import json_schema
    from courier.model.loader import grammar_compiler

    progress("micro: building the grammar tokenizer")
    started = time.perf_counter()
    compiler = grammar_compiler(loaded, capacity=DEFAULT_CAPACITY)
    tokenizer_build_s = time.perf_counter() - started
    if compiler is None:
        raise BenchmarkError("grammar_compiler() gave no compiler for the embedded model")
    encode = loaded.tokenizer.encode
    tokens = {case.name: list(encode(json.dumps(case.instance), add_special_tokens=False)) for case in SCHEMAS}
    progress(f"micro: compile times, {args.micro_repeats} repeats per schema")
    compiles = time_compiles(compiler, tokens, args.micro_repeats)
    constraints = [json_schema(case.schema, name=case.name, param="micro") for case in SCHEMAS]
    instances = [tokens[case.name] for case in SCHEMAS]
    fills = []
    for lanes in sorted({1, args.micro_sequences}):
        progress(f"micro: mask fills, {lanes} sequence(s), {args.micro_passes} passes")
        fills.append(time_fills(compiler, constraints, instances, lanes, args.micro_passes))
    progress("micro: ConstrainedSequence per-token path, 1 sequence")
    return Micro(
        vocab_size=compiler.vocab_size,
        eos_tokens=list(compiler.eos_tokens),
        tokenizer_build_s=tokenizer_build_s,
        compiles=compiles,
        fills=fills,
        step_ms=time_steps(loaded, compiler, constraints, instances),
        compiler_stats=asdict(compiler.stats()),
    )


def print_micro(micro: Micro) -> None:
    print("### (c) Micro-benchmarks (in process, no server)\n")
    print(
        f"Vocabulary {micro.vocab_size}, end-of-sequence {micro.eos_tokens}; grammar tokenizer built in "
        f"{micro.tokenizer_build_s:.2f} s (`grammar_compiler(loaded, capacity)`, once per model).\n"
    )
    table(
        "schema | grammar bytes | constraint build ms | compile cold ms | matcher cached ms | instance tokens",
        (
            f"{c['schema']} | {c['grammar_bytes']} | {c['constraint_build_ms']:.2f} | {c['compile_cold_ms']:.2f} "
            f"| {c['matcher_cached_ms']:.3f} | {c['instance_tokens']}"
            for c in micro.compiles
        ),
    )
    print("Mask fill before each token (`MaskFiller`, llguidance's parallel fill), end-of-sequence included:\n")
    table(
        "sequences | fills | tokens | fill p50 ms | fill p99 ms | fill mean ms | per token p50 us | per token p99 us "
        "| tokens refused | EOS refused",
        (
            f"{f['sequences']} | {f['fills']} | {f['tokens']} | {f['fill_p50_ms']:.3f} | {f['fill_p99_ms']:.3f} "
            f"| {f['fill_mean_ms']:.3f} | {f['per_token_p50_us']:.0f} | {f['per_token_p99_us']:.0f} | {f['refused']} "
            f"| {f['eos_refused']}"
            for f in micro.fills
        ),
    )
    step = micro.step_ms
    print(
        f"- one constrained sequence's whole per-token path (`ConstrainedSequence.process` + `.sample`, mask to "
        f"MLX, evaluated), {len(step)} tokens: p50 {percentile(step, 0.5):.3f} ms, p99 {percentile(step, 0.99):.3f} "
        f"ms, mean {statistics.fmean(step):.3f} ms"
    )
    print(f"- compiler stats: {micro.compiler_stats}\n")

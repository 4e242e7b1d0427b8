"""What the compaction summary's grammar costs per token (compile time, mask time over a summary's tokens) on the
embedded SmolLM2's vocabulary, beside a plain lines regex and a JSON schema."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from bench.harness import cli
from bench.harness.models import cache_directory, prepare_4bit_dir
from bench.harness.report import table, write_json
from courier.grammar.compiler import GrammarCompiler, build_tokenizer
from courier.grammar.constraint import Constraint, json_schema, lark_constraint
from courier.grammar.summary import LINE_CHARS, MAX_LINES, summary_constraint

VOCAB_SIZE = 49152
ITINERARY = "".join(f"- Day {day}: museum {day}, cafe {day}, a walk by the river\n" for day in range(1, 40))
WORDS = [
    *("museum", "cafe", "river", "Day", "dinner", "walk", "über", "café", "東京", "naïve"),
    *(",", ".", ":", ";", "-", "12", "345"),
]


@dataclass(frozen=True, slots=True)
class Timing:
    grammar: str
    text: str
    compile_ms: float
    tokens: int
    mean_mask_ms: float
    max_mask_ms: float


def mixed_lines(seed: int = 1) -> str:
    chooser = random.Random(seed)
    lines = (" ".join(chooser.choice(WORDS) for _ in range(chooser.randint(5, 60))) for _ in range(40))
    return "".join(f"- {line[: LINE_CHARS - 1]}\n" for line in lines)


def measure(compiler: GrammarCompiler, name: str, constraint: Constraint, text_name: str, text: str) -> Timing:
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    started = time.perf_counter()
    compiled = compiler.compile(constraint, "bench")
    compile_ms = (time.perf_counter() - started) * 1000
    matcher = compiler.matcher(compiled)
    mask = allocate_token_bitmask(1, compiler.vocab_size)
    times: list[float] = []
    for token in compiler.tokenizer.tokenize_str(text):
        started = time.perf_counter()
        fill_next_token_bitmask(matcher, mask, 0)
        times.append((time.perf_counter() - started) * 1000)
        if not matcher.consume_token(token):  # the budget is spent: only the end may follow
            break
    return Timing(name, text_name, compile_ms, len(times), statistics.fmean(times), max(times))


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--chars", type=cli.positive_ints, default=[64, 256, 1024], help="summary budgets")
    cli.add_results(parser)
    args = parser.parse_args()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    with cache_directory(args.cache_dir) as cache:
        wrapper = load_tokenizer(prepare_4bit_dir(cache))
    compiler = GrammarCompiler(build_tokenizer(wrapper._tokenizer, VOCAB_SIZE, wrapper.eos_token_ids))
    texts = {"itinerary": ITINERARY, "mixed": mixed_lines()}
    line = f"- [^\\n]{{1,{LINE_CHARS}}}"
    plain = f"start: LINES\nLINES: /({line}\\n){{0,{MAX_LINES - 1}}}{line}\\n?/\n"
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    timings: list[Timing] = []
    for chars in args.chars:
        for text_name, text in texts.items():
            timings.append(measure(compiler, f"summary ({chars} chars)", summary_constraint(chars), text_name, text))
    plain_constraint = lark_constraint(plain, label="lines", param="bench")
    timings.append(measure(compiler, "lines regex, no `&`", plain_constraint, "itinerary", ITINERARY))
    string = '{"a": "' + ITINERARY.replace("\n", " ")
    timings.append(
        measure(compiler, "json_schema (one string)", json_schema(schema, name="s", param="bench"), "same", string)
    )
    table(
        "grammar | text | compile ms | tokens | mean mask ms | max mask ms",
        (
            f"{t.grammar} | {t.text} | {t.compile_ms:.1f} | {t.tokens} | {t.mean_mask_ms:.2f} | {t.max_mask_ms:.2f}"
            for t in timings
        ),
    )
    write_json(timings, args.json)


if __name__ == "__main__":
    main()

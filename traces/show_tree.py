"""Print the spans of a Courier `--trace-file` as one indented tree per trace.

python traces/show_tree.py traces/examples/tokenize-chat.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from datetime import datetime
from typing import Any


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def main(path: str) -> None:
    with open(path, encoding="utf-8") as handle:
        spans = [json.loads(line) for line in handle if line.strip()]
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        children[span.get("parent_id")].append(span)
    for group in children.values():
        group.sort(key=lambda span: span["start_time"])

    def show(span: dict[str, Any], depth: int) -> None:
        duration_ms = (_time(span["end_time"]) - _time(span["start_time"])).total_seconds() * 1000
        attributes = span.get("attributes") or {}
        status = attributes.get("http.response.status_code", "")
        print(f"{'  ' * depth}{span['name']}  {duration_ms:.2f} ms {status}".rstrip())
        for child in children.get(span["context"]["span_id"], []):
            show(child, depth + 1)

    for root in children[None]:
        print(f"trace {root['context']['trace_id']}")
        show(root, 1)


if __name__ == "__main__":
    main(sys.argv[1])

"""Multi-turn prompt-cache reuse of Courier against mlx_lm.server, side by side; the snapshot store's latency; its disk
tier.

Four parts, selected with `--parts` (a, b and c by default; d only when asked for, see below):

a. One conversation on the embedded SmolLM2-135M-Instruct: a ~300-token system prompt, then
   `--turns` (10) short user messages, each sent as a streaming chat completion (`max_tokens`
   24, temperature 0) with the whole history; the assistant's reply is appended to the history
   before the next turn. Per turn: TTFT (request sent .. first content delta), `prompt_tokens`
   and `usage.prompt_tokens_details.cached_tokens`. Servers (`--a-servers`):

   - `courier`: `courier serve --port P --cache-dir C` (embedded model; float32 on OpenBLAS);
   - `mlx-lm-f32`: `LD_PRELOAD=<OpenBLAS> python -m mlx_lm.server --model DIR_F32 --port P
     --log-level WARNING` on the same weights dequantized to float32 (bench.throughput's
     tuned server; its concurrency flags do not matter for one stream);
   - `mlx-lm-4bit`: `python -m mlx_lm.server --model DIR4 --port P`, as shipped;
   - `courier-baseline` (only with `--baseline-tree DIR`, and then by default, right after
     `courier`): see below.

b. K conversations (`--conversations`, 2,8,32) interleaved turn by turn (conversation 1 turn 1,
   conversation 2 turn 1, ..., conversation 1 turn 2, ...), one request at a time, each
   conversation with its own `user` field and system prompt, `--b-turns` (4) turns of
   `max_tokens` 32 (`--b-max-tokens`), on two tiny random-weight models built by
   `tests/support/tiny_models.py`: a dense llama (trimmable KV cache) and a hybrid qwen3_next
   (gated-delta layers; not trimmable). A system prompt is a header naming the customer (so no
   two conversations share a prefix worth reusing) and then a shop's support handbook, cut at
   a word to `--b-system-tokens` (550) tokens in all; a user message is one short question
   ("Message 2: Where is my parcel?", 20 tokens with its chat-template tokens). Per server,
   model, budget and K: the share of turn-2+ prompt tokens served from the cache (sum cached /
   sum prompt over turns >= 2), the share of turns 2+ that were warm (at least the
   conversation's whole previous prompt but its 3-token generation prompt came from the cache;
   a system prompt alone does not count) and TTFT p50 (turns >= 2, and turn 1 apart). Every
   (server, model, budget, K) gets a fresh server process. Budgets (`--b-budgets`):

   - `default`: both servers with their defaults (Courier sizes its store from the model,
     at least 512 MiB; mlx_lm.server keeps 10 caches, `--prompt-cache-size 10`, no byte cap);
   - `size100`: mlx_lm.server with `--prompt-cache-size 100`, the issue's anchor. Up to K=8 it
     evicts nothing here (a conversation leaves at most 1 + 2 x 4 caches on a hybrid model);
   - `equal`: one byte budget B for both, with K swept over `--equal-conversations`
     (4-16, 20, 24). B is `--budget-states` (16) model states of one conversation at its
     last prompt (the system prompt, 4 questions and 3 replies of `--b-max-tokens` one-token
     words: about 730 tokens), weighed in this process on mlx-lm's own cache of the tiny
     model, contents only (a KV cache's 256-token growth buffer not counted). No server's
     footprint sizes it: it is room for 16 conversations for a server that keeps exactly one
     state per conversation. `--budget-bytes` sets B directly. Courier gets
     `--prompt-cache-snapshot-capacity-bytes B`; mlx_lm.server gets `--prompt-cache-bytes B`
     and `--prompt-cache-size 4096` (Courier's default entry cap), so that bytes, not its
     10-entry default, are what binds. Each is charged by its own accounting of what it
     holds: mlx_lm.server counts its KV buffers as allocated, Courier its compact copies.

   Conversations held warm at B, per server and model: the largest swept K up to which the
   server's cached share at B stays >= 80% of its own share with an unconstrained cache at K=8
   (Courier: `default`; mlx_lm.server: `size100`); the ratio Courier / mlx_lm.server is the
   issue's second target (>= 1.5x). With round-robin turns and LRU eviction a share falls off
   a cliff once the conversations stop fitting (the entry evicted is the one asked for next),
   so the threshold only has to tell warm from thrashing. It does not by itself keep out a
   fallback to a conversation's system-prompt cache, which leaves the whole history to
   prefill yet, with 550-token system prompts, would serve about 81% of the tokens: read the
   warm-turns column beside it (in the run in docs/benchmarks.md mlx_lm.server's thrashing
   runs served 0-54%).

   Why replies of 32 tokens: an assistant's reply of a sentence or two. A server that cannot
   follow the reply as the chat template re-renders it into the next prompt prefills it again
   (mlx_lm.server does; Courier extends the conversation over it while idle), so unrealistically
   short replies hide that difference; and at the earlier 8 tokens each turn's new question (20
   tokens, which no cache can serve) was 5.4% of the turns-2+ prompt tokens, so no server
   could reach the issue's 95%.

   Why 550 tokens of system prompt: the issue's anchor measurement is that mlx_lm.server with
   `--prompt-cache-size 100`, serving 8 conversations interleaved on a hybrid model, serves 92%
   of turns-2+ prompt tokens from cache. Measured on this workload with 32-token replies (K=8,
   qwen3_next): 450 tokens 91.3%, 550 91.8%; 550 reproduces it to the percent. (With 8-token
   replies 285 tokens did: 250 91.0%, 285 92.0%, 300 93.0%.) The new questions are then 2.9%
   (hybrid) to 3.2% (dense) of the turns-2+ prompt tokens, so no server can pass about 97.1%
   (hybrid) or 96.9% (dense).

   mlx_lm.server (`mlx-lm-f32`) serves the tiny float32 weights with `LD_PRELOAD=<OpenBLAS>`
   and `--log-level WARNING`. It has no sessions: it ignores `user` and shares one cache across
   requests. It applies `--prompt-cache-bytes` when it admits a request, after that request's
   cache lookup, so between requests its cache may hold more than B.
   Courier's `snapshot_entries`, `snapshot_evictions_lru` and `snapshot_self_evictions` are
   printed after each K (its store is reset after the warm-up request, so they count the
   conversations only; mlx_lm.server keeps its warm-up cache).

   Servers: `--b-servers` (courier,mlx-lm-f32; plus courier-baseline with `--baseline-tree`).

c. In-process latency of `courier.core.snapshot_store.SnapshotStore`: `--store-entries`
   (10,000) token vectors sharing a 500-token system prefix followed by 50-1500 random tokens,
   inserted one by one under `--store-sessions` sessions, then `--store-lookups` lookups of
   each kind: the next turn of a stored conversation (hit on the whole entry), a new
   conversation on the shared system prefix (hit on the prefix, trimmed) and an unrelated
   prompt (miss). All token vectors are made before anything is timed. Reported: p50/p99 in
   microseconds per kind and for inserts (target: lookups well under 1 ms).

d. The prompt cache's disk tier (`--prompt-cache-disk-bytes`, `--prompt-cache-dir`), side by side with mlx_lm.server,
   which has none. Not in the default run: it starts 23 server processes, takes about 27 minutes on a 2-core
   machine and writes hundreds of megabytes to disk, so ask for it with `--parts d` (or `--parts a,b,c,d`). Three
   sections (`--d-sections`, 1,2,3), each on fresh server processes; servers `--d-servers` (courier,mlx-lm-f32).

   d1. Many conversations, a memory budget for 8. K conversations (`--d-conversations`, 8,32,128) interleaved turn by
       turn exactly as in part b (the same system prompts of `--b-system-tokens`, questions and `--b-max-tokens`
       replies, each conversation its own `user`), `--d-turns` (4) turns each, on both tiny models (`--d-models`). The
       memory budget B8 holds 8 conversations (`--d-budget-conversations`): 8 model states of one conversation at its
       last prompt (after `--d-turns` turns), weighed as part b weighs its equal budget (mlx-lm's own cache of the tiny
       model in this process, contents only), not from Courier's snapshot_bytes_per_entry, so no server's own accounting
       sizes it (`--d-budget-bytes` sets it directly). Courier runs with `--prompt-cache-snapshot-capacity-bytes B8
       --prompt-cache-disk-bytes D --prompt-cache-dir DIR`, D being `--d-disk-bytes` (2 GiB: a tiny model's snapshot is
       about 0.3 MB, so every conversation of K=128 fits many times over and the disk tier never evicts) and DIR an
       empty directory per run under CACHE/bench-prompt-cache, deleted after it; mlx_lm.server (`mlx-lm-f32`) as at part
       b's equal budget, `--prompt-cache-bytes B8 --prompt-cache-size 4096`. Every (server, model, K) is a fresh
       process; Courier's cache is reset after the warm-up request, once Courier is idle (see d2), so only the
       conversations are in it. Reported as in part b (share of turns-2+ prompt tokens served from cache, warm turns,
       TTFT p50 of turns 2+ and of turn 1), the wall time of the server process (start to exit), and for Courier its
       `/v1/cache/stats` once idle after the last turn: entries in memory and on disk, snapshot_disk_hits (lookups
       answered by an entry only on disk), snapshot_spills (memory evictions that kept the entry on disk),
       snapshot_disk_restores (files read back into memory), mean read and write milliseconds, and
       snapshot_lookups_timed_out (lookups the scheduler stopped waiting for past its deadline, 2 s since commit
       3cd0db6, and served as misses: a slow restore shows there). Other signs of trouble (read errors, unreadable
       files, write failures or losses, writes or restores refused, disk LRU evictions) are listed under the table when
       not 0. Target: >= 90% of turns-2+ prompt tokens from cache at the largest K (128). With round-robin turns and 8
       conversations' room in memory, a conversation's snapshot left memory about K - 8 turns before its next turn
       comes, so nearly every turn 2+ is served from disk (even at K=8: B8 counts states at their last prompt, and
       Courier also holds the turn in flight's boundary and completion snapshots, so memory keeps fewer than 8
       conversations); mlx_lm.server keeps nothing beyond what B8 holds and thrashes there (LRU evicts the cache asked
       for next). The tiny models keep each turn's own work small, so K=128 x 4 turns takes minutes per server; if a
       machine is too slow for that, `--d-turns 3` cuts a quarter.

   d2. After a restart. `--d-restart-conversations` (32) conversations, `--d-turns` turns each as in d1 (same
       budget, flags and a fresh directory), on each tiny model; then the server is stopped, started again with the
       same command (same model, flags and --prompt-cache-dir), and every conversation gets one more turn.
       Reported: the share of those next turns' prompt tokens served from cache (target >= 90%), the share of them
       that found their whole history (warm), their TTFT p50, snapshot_disk_adopted right after the restart (files
       of the earlier run re-indexed), disk hits and restores since, how long the stopped process took to exit and
       its exit status, and Courier's state at the signal. Stops (`--d-restart-signals`, term,kill):
       - SIGTERM right after the last reply, without waiting: a clean stop must itself flush what memory holds
         without a file (warm-ups still queued are dropped, so the next turn may prefill its previous reply);
       - SIGKILL (`kill -9`) only once Courier is idle: `/v1/cache/stats` polled every 0.2 s until
         snapshot_warmups_pending and snapshot_disk_pending (writes and deletes queued or under way) are 0 and
         the counters of warm-ups queued, run and skipped, inserts, disk writes and disk writes skipped have not
         moved since the previous poll, so the kill measures what write-behind kept rather than a race with it.
       mlx_lm.server is run too, with the first signal only (it keeps nothing across a restart however it stops):
       its cache starts empty, so only template tokens the next turns happen to share can be cached.

   d3. Disk-hit TTFT on the embedded SmolLM2 (Courier's default model and float32 weights; no `--model`, as part a).
       One conversation of `--d-history-tokens` (2,000) prompt tokens: a system prompt (a customer header and the
       part b handbook cut to size), three exchanges written out and a question, streamed with max_tokens
       `--d-ttft-max-tokens` (8), temperature 0, its own `user`; TTFT as in part a (request sent .. first content
       delta). A memory-only Courier (`--prompt-cache-disk-bytes 0`, default budget) first answers it once and,
       once idle (as in d2), weighs the conversation's snapshot at rest, alone in the store
       (snapshot_bytes_per_entry: E, about 93 MB at 2,000 tokens in float32). The measured Courier runs with
       `--prompt-cache-snapshot-capacity-bytes 2.5E` (`--d-ttft-capacity-bytes` sets it), `--d-disk-bytes` and an
       empty directory. Per repeat (`--d-ttft-repeats`, 5), Courier idle before every reset and every request:
       (i) cold: `POST /v1/cache/reset`, then the prompt; (ii) a filler conversation of the same length (another
       customer: no prefix worth sharing) cold, whose prefill-boundary and completion snapshots push the target's
       out of memory (its file stays: write-behind), then the prompt again: a disk hit; (iii) the prompt once more:
       a memory hit. Why 2.5 snapshots' room and not just over one: a hit on the same prompt stores two snapshots
       of that size itself (a boundary at the restored prefix and the completion), so with room for one, everything
       else leaves memory at once and the memory hit that follows is read from disk again; with 2.5 the filler's
       two snapshots still push the target's out, and after the disk hit its own snapshots stay. Every sample is
       verified from the stats gained between the idle state before it and just after its reply (an idle warm-up
       starting at once may add a lookup of its own): cold, at most 32 tokens cached; a disk hit, snapshot_disk_hits
       grown and cached_tokens at least the prompt but its 3-token generation prompt; a memory hit, the same tokens
       with snapshot_memory_hits grown and snapshot_disk_hits not. P50s are over verified samples; the target is a
       disk hit's TTFT p50 <= 0.3x the cold one's. For context (`mlx-lm-f32`): mlx_lm.server on the float32 weights
       (as part a), per repeat a prompt of the same shape for another customer (cold: only a few template tokens
       can be cached) and the same prompt again (a memory hit); it has no disk tier.

Every server runs on 127.0.0.1 on a free port, one at a time, and gets one warm-up request
before anything is measured; a server run stops after `--run-timeout` seconds of measuring.
mlx_lm.server runs get `HF_HUB_CACHE` set to an empty directory (see bench.throughput). From
the repository root:

    .venv/bin/python -m bench.multiturn [--parts a,b,c,d] [--conversations 2,8,32] [--turns 10]
        [--a-servers courier,mlx-lm-f32,mlx-lm-4bit] [--b-models llama,qwen3_next]
        [--b-servers courier,mlx-lm-f32] [--b-budgets default,size100,equal]
        [--b-system-tokens 550] [--b-max-tokens 32] [--equal-conversations 4,8,12]
        [--cache-dir DIR] [--json PATH] [--courier-arg=--admission-window-ms=0 ...]
        [--baseline-tree /tmp/courier-baseline]
        [--d-sections 1,2,3] [--d-models llama,qwen3_next] [--d-servers courier,mlx-lm-f32]
        [--d-conversations 8,32,128] [--d-turns 4] [--d-restart-conversations 32] [--d-restart-signals term,kill]
        [--d-ttft-repeats 5] [--d-history-tokens 2000]

`--courier-arg` adds a flag to every Courier command line (none by default: defaults are measured).

`--baseline-tree DIR` (a checkout of another commit, e.g. `git worktree add /tmp/courier-baseline
COMMIT`) adds `courier-baseline` to parts a and b by default: Courier at that commit, to show that
a change is not slower. It is started like `courier`, with the same flags (`--courier-arg`, the
equal budget's capacity) and as `PYTHONPATH=DIR python -P -m courier serve ...` out of the same
virtualenv (`-P` keeps the working directory, which holds this tree's `courier`, off the front of
sys.path; the script checks at start-up that DIR's package is the one imported, and stops if not),
and measured exactly like it (cache reset after the warm-up, `/v1/cache/stats`, Courier's default
budget as its unconstrained reference). It runs next to `courier` (after it, or before it when listed
first): in part a beside its conversation, in part b at each K (courier K=2, courier-baseline K=2, ...),
so drift on a noisy machine hits both alike. The report adds "courier / courier-baseline" lines:
the share of turns-2+ prompt tokens cached and TTFT p50 of turns 2+ (part a, and part b for each
model, budget and K), and conversations held warm at the equal budget.
Part d has no `courier-baseline`: a commit before the disk tier has none of its flags.

Markdown tables go to stdout, progress to stderr, server logs to CACHE/bench-logs.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

from bench.throughput import (
    COURIER,
    COURIER_BASELINE,
    COURIER_MODEL_ID,
    HOST,
    MLX_LM_4BIT,
    MLX_LM_F32,
    MLX_LM_MODEL_ID,
    OPENBLAS_PATH,
    WARMUP_PROMPT,
    BenchmarkError,
    add_baseline_argument,
    baseline_ready,
    cache_directory,
    choose_servers,
    courier_launcher,
    environment,
    free_port,
    in_run_order,
    is_courier,
    load_float32,
    percentile,
    positive_ints,
    prepare_4bit_dir,
    progress,
    ready_path,
    release_mlx_memory,
    running_server,
    save_float32_dir,
    server_env,
    server_extra_env,
    server_list,
    wait_until_ready,
)
from courier.platform.blas import load_optimized_blas

PARTS = ("a", "b", "c", "d")
DEFAULT_PARTS = ("a", "b", "c")  # part d only when asked for: see the module docstring
TINY_MODELS = ("llama", "qwen3_next")
A_SERVERS = (COURIER, MLX_LM_F32, MLX_LM_4BIT)
B_SERVERS = (COURIER, COURIER_BASELINE, MLX_LM_F32)
DEFAULT_BUDGET = "default"
ANCHOR_BUDGET = "size100"
EQUAL_BUDGET = "equal"
B_BUDGETS = (DEFAULT_BUDGET, ANCHOR_BUDGET, EQUAL_BUDGET)
ANCHOR_CACHE_SIZE = 100  # the issue's anchor: mlx_lm.server --prompt-cache-size 100
TINY_SERVED_NAME = "tiny"
COURIER_DEFAULT_MAX_ENTRIES = 4096  # `--prompt-cache-snapshot-max-entries` default, given to mlx_lm.server too
DEFAULT_SYSTEM_TOKENS_B = 550  # calibrated: see the module docstring
DEFAULT_MAX_TOKENS_B = 32  # an assistant reply of a sentence or two: see the module docstring
EQUAL_CONVERSATIONS = [*range(4, 17), 20, 24]
BUDGET_STATES = 16
REFERENCE_K = 8
WARM_FRACTION = 0.8
GENERATION_PROMPT_TOKENS = 3  # "<|im_start|>assistant\n": re-rendered with the reply, so a warm turn may redo it
REQUEST_TIMEOUT_S = 300.0
RUN_ERRORS = (BenchmarkError, openai.OpenAIError, httpx.HTTPError, OSError)
T = TypeVar("T")

# Part a: ~300 tokens of system prompt (SmolLM2 tokenizer), then short user turns.
SYSTEM_PROMPT_A = (
    "You are Quill, the customer assistant of Larkspur Books, an independent bookshop with two stores and an online "
    "catalogue. Answer in one or two short sentences, in plain English, and never invent facts about orders, prices "
    "or stock. Opening hours: the Market Street store is open Monday to Saturday from 9:00 to 19:00 and Sunday from "
    "11:00 to 17:00; the Harbour Road store is open every day from 10:00 to 18:00. Orders placed online before 14:00 "
    "ship the same working day; standard delivery takes two to four working days and is free above 30 euros, "
    "otherwise it costs 3.90 euros. Express delivery costs 7.50 euros and arrives the next working day. Returns are "
    "accepted within 30 days with the receipt, in the original condition; gift cards and special orders cannot be "
    "returned. Members of the Larkspur Reading Club get 10 percent off every purchase, early invitations to author "
    "evenings and one free coffee a month in the Market Street cafe. Special orders for books that are not in stock "
    "usually arrive within five to ten working days, and the customer is called as soon as the book is in. When a "
    "question is about something you do not know, say so politely and suggest calling the store at 555 0142 or "
    "writing to help@larkspur.example. Be warm but brief and do not use lists or headings."
)
USER_MESSAGES_A = (
    "Hello! Are you open on Sunday?",
    "Which store is closer to the harbour?",
    "How long does standard delivery take?",
    "Is delivery free for a 25 euro order?",
    "Can I return a gift card?",
    "What do Reading Club members get?",
    "How long does a special order take?",
    "Can I get express delivery tomorrow?",
    "What is your phone number?",
    "Thanks, that is all for today.",
)

# Part b: a system prompt of its own per conversation (a header naming the customer, so the conversations share no
# prefix worth reusing, then the shop's handbook cut to `--b-system-tokens`), short questions.
HANDBOOK_B = (
    "Follow these rules in every answer: be brief and friendly, answer in one sentence when you can, never make up "
    "order numbers, prices or delivery dates, ask one clarifying question when the request is unclear, and offer "
    "to hand the conversation to a human colleague when the customer is unhappy or asks for one. Keep a calm tone. "
    "Orders: an order can be changed or cancelled free of charge until it has been handed to the carrier, which "
    "usually happens within four working hours of payment; after that the customer has to wait for the parcel and "
    "return it. Every confirmation email carries the order number, the items, the delivery address and a link to "
    "the order page, where the customer can follow each step. If the customer cannot find the email, suggest "
    "looking in the spam folder and then offer to resend it to the address on the account, never to a new one. "
    "Delivery: standard delivery takes two to four working days and is free above 40 euros, otherwise it costs "
    "4.50 euros; express delivery costs 9 euros and arrives the next working day when ordered before 13:00. "
    "Parcels to islands and to addresses outside the mainland take two days longer. The carrier tries twice, then "
    "leaves the parcel at the nearest pickup point for ten days, after which it comes back to the warehouse and the "
    "order is refunded minus the delivery costs. A delivery address can be changed until the parcel is handed to "
    "the carrier; after that only the carrier can redirect it, through the link in its tracking email. "
    "Tracking: the tracking link arrives by email as soon as the carrier scans the parcel, usually the same "
    "evening. A parcel that has shown no movement for three working days is treated as delayed: apologise, open a "
    "carrier inquiry, and tell the customer they will hear from us within two working days. A parcel that shows as "
    "delivered but has not arrived must be reported within seven days; ask the customer to check with neighbours "
    "and the building's letterboxes first, then open a claim. Never promise a delivery date the carrier has not "
    "confirmed. "
    "Returns: items can be returned within 30 days of delivery in their original condition with all labels "
    "attached; underwear, swimwear, earrings, gift cards and made-to-measure items cannot be returned for hygiene "
    "or practical reasons. The return label is free for members and costs 3.90 euros for everybody else. Refunds go "
    "back to the original means of payment within five working days after the warehouse receives the return; bank "
    "transfers can take two more days. Exchanges are handled as a return plus a new order, so suggest placing the "
    "new order at once if the size or colour is in stock. "
    "Products and stock: the product page shows the stock of every size and colour, updated every fifteen minutes. "
    "When an item is sold out the customer can ask for an email when it is back; we cannot reserve items or "
    "promise restock dates. Colours on screens differ slightly from the real fabric, so describe colours with the "
    "words used on the product page. Care instructions are on the label and on the product page; recommend washing "
    "dark colours inside out and at 30 degrees. "
    "Payments: we accept cards, PayPal, Apple Pay, Google Pay, gift cards and, for orders above 100 euros, bank "
    "transfer in advance; the order ships once the transfer arrives, which takes one to three working days. Cash on "
    "delivery is not available. If a payment failed, the order is kept for 48 hours so the customer can pay again "
    "from the order page. Never ask for full card numbers, security codes or passwords, and never accept them if a "
    "customer types them: ask them to delete the message. "
    "Accounts: a password is reset from the sign-in page with the link 'Forgot your password?'; the link is valid for "
    "one hour. We cannot see or send passwords. An email address can be changed in the account settings after "
    "confirming the old one. Accounts are deleted on request within 30 days; orders are kept for seven years "
    "because the law requires it. "
    "Discounts: students get 10 percent off with a valid student card verified once a year through our partner "
    "site; members collect one point per euro and get a 5 euro voucher for every 100 points. Only one discount code "
    "can be used per order, codes cannot be applied after the order is placed, and vouchers cannot be exchanged for "
    "cash. During sales, the price shown at checkout is the price paid; we do not refund differences when prices "
    "drop later. "
    "Complaints: listen first, apologise for the trouble without blaming the carrier or colleagues, and say exactly "
    "what happens next and when. Offer a human colleague whenever the customer asks, is upset, or the request needs "
    "an exception to these rules, for example a return after 30 days, a refund to a different account, or a "
    "compensation. Colleagues answer between 8:00 and 20:00 on working days, usually within one hour. "
    "Privacy: only discuss an order with the person whose account it belongs to; ask for the order number and the "
    "email address on the order before giving any detail. Never read out a full address or phone number; confirm "
    "only the town. Do not store or repeat personal details that the customer did not need to give. "
    "Style: write plain sentences without lists, headings or emojis, use the customer's words, avoid jargon, and "
    "end with a short question only when you need an answer to go on."
)
QUESTIONS_B = (
    "Where is my parcel?",
    "Can I change the delivery address?",
    "Do you have this in blue?",
    "How do I reset my password?",
    "Is there a discount for students?",
    "Can I pay by bank transfer?",
)

# Part c.
STORE_PREFIX_TOKENS = 500
STORE_SUFFIX_TOKENS = (50, 1500)
STORE_VOCAB = 49152
STORE_NEXT_TURN_TOKENS = 30
STORE_NEW_CONVERSATION_TOKENS = 200
STORE_MISS_TOKENS = 700
STORE_MIN_PREFIX = 32
STORE_LOOKUP_TARGET_US = 1000.0
LOOKUP_NEXT_TURN = "lookup: next turn (hit, whole entry)"
LOOKUP_SHARED_PREFIX = "lookup: new conversation (hit, shared prefix)"
LOOKUP_MISS = "lookup: unrelated prompt (miss)"

# Part d: the disk tier.
D_SECTIONS = ("1", "2", "3")
D_SERVERS = (COURIER, MLX_LM_F32)
D_CONVERSATIONS = [8, 32, 128]
D_TURNS = 4
D_BUDGET_CONVERSATIONS = 8  # the memory budget holds this many conversations (model states at their last prompt)
D_DISK_BYTES = 2 << 30  # room for every conversation of the largest K many times over
D_RESTART_CONVERSATIONS = 32
D_STOP_SIGNALS = {"term": signal.SIGTERM, "kill": signal.SIGKILL}
D_TTFT_REPEATS = 5
D_HISTORY_TOKENS = 2000
D_TTFT_MAX_TOKENS = 8
D3_CAPACITY_ENTRIES = 2.5  # d3's memory budget, in snapshots of the conversation at rest: see the module docstring
D_TARGET_SHARE = 0.90
D_TARGET_TTFT_RATIO = 0.3
COLD_CACHED_SLACK = 32  # a cold request may still find a few template tokens another conversation shares
IDLE_POLL_S = 0.2
IDLE_TIMEOUT_S = 300.0
STOPPED_WAIT_S = 300.0  # how long a signalled server may take to exit (a SIGTERM flushes snapshots to disk)
# Counters that move while Courier still works for its cache between requests: warm-ups, inserts, disk writes.
IDLE_COUNTERS = (
    "snapshot_warmups_queued",
    "snapshot_warmups_run",
    "snapshot_warmups_skipped",
    "snapshot_inserts",
    "snapshot_disk_writes",
    "snapshot_disk_writes_skipped",
)
COLD = "cold"
FILLER = "filler (cold)"
DISK_HIT = "disk hit"
MEMORY_HIT = "memory hit"
D3_KINDS = (COLD, FILLER, DISK_HIT, MEMORY_HIT)
D3_TARGET_USER = "d3-target"
D3_FILLER_USER = "d3-filler"
D3_TARGET_CUSTOMER = 1
D3_FILLER_CUSTOMER = 2
D3_MLX_CUSTOMERS = 100  # mlx_lm.server's cold prompts: customers 100, 101, ... (no two share a history)
D3_EXCHANGES = (
    (
        "Hello, I ordered a rain jacket last week and it has still not arrived.",
        "I am sorry it is late; could you give me the order number and the email address on the order?",
    ),
    (
        "The order number is 58213 and the email is the one on my account.",
        "Thank you; the parcel left our warehouse on Tuesday and the carrier shows it at your local depot.",
    ),
    (
        "Can I still have it delivered to my office instead of my home?",
        "The parcel is with the carrier already, so only the carrier can redirect it, through its tracking email.",
    ),
)
D3_QUESTION = "If that does not work, can I return it and order it again in another size?"


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLaunch:
    """One server process: how it was started and whether it served."""

    label: str
    command: list[str]
    extra_env: dict[str, str]
    ready_s: float | None = None
    error: str | None = None
    # Part d: how it was stopped when the benchmark stopped it itself (SIGTERM or SIGKILL), how long it took to
    # exit and its exit status.
    stop_signal: str | None = None
    stop_s: float | None = None
    exit_code: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnResult:
    """One streamed chat completion; `conversation` and `turn` count from 1."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    ttft_s: float
    total_s: float
    empty_reply: bool
    reply: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationRun:
    """Part a: one server's conversation."""

    server: ServerLaunch
    turns: list[TurnResult]
    courier_stats: dict[str, Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class InterleavedRun:
    """Part b: K interleaved conversations on one server process."""

    model: str
    budget: str
    budget_bytes: int | None
    conversations: int
    server: ServerLaunch
    cached_share: float | None
    warm_turns: float | None
    ttft_p50_later_s: float | None
    ttft_p50_first_s: float | None
    empty_replies: int
    courier_stats: dict[str, Any] | None
    turns: list[TurnResult]


@dataclass(frozen=True, slots=True, kw_only=True)
class ByteBudget:
    """Part b's equal byte budget for one model, and where it came from."""

    model: str
    capacity_bytes: int
    explanation: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldWarm:
    """Part b: how many conversations one server kept warm at the equal byte budget."""

    model: str
    server: str
    reference_share: float | None  # its cached share with an unconstrained cache at K=REFERENCE_K
    threshold: float | None
    conversations: int | None  # the largest swept K up to which every share stays >= threshold (0: none)
    at_least: bool = False  # every swept K stayed warm: the sweep, not the budget, set the count


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencySummary:
    operation: str
    count: int
    p50_us: float
    p99_us: float
    max_us: float
    unexpected: int  # lookups whose outcome was not the kind's (a hit that missed, ...)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreLatencyResult:
    entries: int
    sessions: int
    prefix_tokens: int
    suffix_tokens: tuple[int, int]
    build_s: float
    operations: list[LatencySummary]


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskRun:
    """Part d1: K interleaved conversations on one server process, a memory budget for 8 conversations and (on
    Courier) a disk tier."""

    model: str
    conversations: int
    budget_bytes: int
    disk_bytes: int | None  # Courier's --prompt-cache-disk-bytes (None: mlx_lm.server, which has no disk tier)
    server: ServerLaunch
    cached_share: float | None
    warm_turns: float | None
    ttft_p50_later_s: float | None
    ttft_p50_first_s: float | None
    empty_replies: int
    measure_s: float | None  # the warm-up request to the last reply
    wall_s: float  # the server process, from its start to its exit
    courier_stats: dict[str, Any] | None  # read once Courier was idle after the last turn
    turns: list[TurnResult]


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartRun:
    """Part d2: K conversations on one server process, which is then stopped with `stop` and started again on the
    same model, flags and prompt-cache directory; then one more turn of every conversation."""

    model: str
    label: str
    conversations: int
    stop: str  # SIGTERM or SIGKILL
    before: ServerLaunch
    after: ServerLaunch | None
    idle_wait_s: float | None  # before a SIGKILL: how long until Courier was idle
    stats_at_stop: dict[str, Any] | None  # Courier, just before the signal
    stats_at_start: dict[str, Any] | None  # Courier, right after the restart (snapshot_disk_adopted)
    stats_after: dict[str, Any] | None  # Courier, after the next turns
    cached_share_before: float | None  # turns 2+ before the stop
    cached_share_after: float | None  # the next turn of every conversation, after the restart
    warm_after: float | None  # the share of those next turns that found their whole history
    ttft_p50_after_s: float | None
    turns_before: list[TurnResult]
    turns_after: list[TurnResult]


@dataclass(frozen=True, slots=True, kw_only=True)
class TtftSample:
    """Part d3: one timed request and what the cache did for it."""

    kind: str  # COLD, FILLER, DISK_HIT or MEMORY_HIT
    repeat: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int | None
    disk_hits: int | None  # Courier's snapshot_disk_hits gained on this request
    memory_hits: int | None  # snapshot_memory_hits gained
    restores: int | None  # snapshot_disk_restores gained
    lookups_timed_out: int | None  # snapshot_lookups_timed_out gained
    verified: bool  # it was what its kind says (see `ttft_sample`)


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTtft:
    """Part d3 on one server: TTFT of one ~2,000-token prompt on SmolLM2, cold and from each tier."""

    server: ServerLaunch
    probe: ServerLaunch | None  # Courier: the server that weighed the conversation's snapshot
    probe_stats: dict[str, Any] | None  # the probe's stats once idle: the conversation alone in the store
    entry_bytes: int | None  # the conversation's snapshot at rest, as Courier counts it (bytes per entry)
    capacity_bytes: int | None  # the memory budget the measured Courier ran with
    samples: list[TtftSample]
    courier_stats: dict[str, Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierResult:
    budget_conversations: int  # d1, d2: the memory budget holds this many conversations
    budgets: list[ByteBudget]
    runs: list[DiskRun]
    restarts: list[RestartRun]
    ttft: list[DiskTtft]
    wall_s: dict[str, float]  # per section


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    conversation: list[ConversationRun]
    interleaved: list[InterleavedRun]
    budgets: list[ByteBudget]
    held_warm: list[HeldWarm]
    store: StoreLatencyResult | None
    disk_tier: DiskTierResult | None = None


# ---------------------------------------------------------------- servers


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSpec:
    """What to start: `label` is one of bench.throughput's server names."""

    label: str
    model_dir: Path | None
    flags: tuple[str, ...] = ()

    @property
    def served_model(self) -> str:
        if not is_courier(self.label):
            return MLX_LM_MODEL_ID
        return COURIER_MODEL_ID if self.model_dir is None else TINY_SERVED_NAME

    def command(self, port: int, cache_dir: Path) -> list[str]:
        if is_courier(self.label):
            command = [*courier_launcher(self.label), "serve", "--port", str(port), "--cache-dir", str(cache_dir)]
            if self.model_dir is not None:
                command += ["--model", str(self.model_dir), "--served-model-name", TINY_SERVED_NAME]
            return command + list(self.flags)
        command = [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model_dir), "--port", str(port)]
        return command + list(self.flags)


def serve_and_measure(
    spec: ServerSpec,
    cache_dir: Path,
    log_name: str,
    args: argparse.Namespace,
    measure: Callable[[str], T],
    *,
    stop_signal: signal.Signals | None = None,
) -> tuple[ServerLaunch, T | None]:
    """Start `spec`, wait until ready, run `measure(base_url)`, stop it; failures land in the launch's error.

    With `stop_signal` the server is stopped with that signal right after `measure` and waited for (its exit time
    and status are recorded); otherwise with SIGTERM, then SIGKILL after bench.throughput's stop timeout."""
    port = free_port()
    command = spec.command(port, cache_dir)
    extra_env = server_extra_env(spec.label, args.openblas, cache_dir, baseline_tree=args.baseline_tree)
    log_path = cache_dir / "bench-logs" / f"multiturn-{log_name}.log"
    env_text = " ".join(f"{key}={value}" for key, value in extra_env.items())
    progress(f"{log_name}: starting {env_text + ' ' if env_text else ''}{shlex.join(command)} (log: {log_path})")
    ready_s: float | None = None
    stop_s: float | None = None
    exit_code: int | None = None
    signal_name = stop_signal.name if stop_signal is not None else None
    failure: str | None = None
    result: T | None = None
    try:
        with running_server(command, server_env(extra_env), log_path) as process:
            ready_s = wait_until_ready(process, f"http://{HOST}:{port}{ready_path(spec.label)}", log_path)
            progress(f"{log_name}: ready after {ready_s:.1f} s")
            result = measure(f"http://{HOST}:{port}")
            if stop_signal is not None:
                stop_s, exit_code = stop_with(process, stop_signal, log_name)
    except RUN_ERRORS as error:
        failure = f"{type(error).__name__}: {error}"
        progress(f"{log_name}: FAILED: {failure}")
    launch = ServerLaunch(
        label=spec.label,
        command=command,
        extra_env=extra_env,
        ready_s=ready_s,
        error=failure,
        stop_s=stop_s,
        exit_code=exit_code,
        stop_signal=signal_name,
    )
    return launch, result


def stop_with(process: subprocess.Popen[bytes], stop_signal: signal.Signals, log_name: str) -> tuple[float, int]:
    """Send `stop_signal` and wait for the process to exit: the seconds it took and its exit status."""
    started = time.monotonic()
    process.send_signal(stop_signal)
    try:
        code = process.wait(timeout=STOPPED_WAIT_S)
    except subprocess.TimeoutExpired as error:
        raise BenchmarkError(f"{log_name}: still running {STOPPED_WAIT_S:.0f} s after {stop_signal.name}") from error
    stop_s = time.monotonic() - started
    progress(f"{log_name}: {stop_signal.name}: exited with {code} after {stop_s:.2f} s")
    return stop_s, code


def make_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def courier_stats(base_url: str) -> dict[str, Any]:
    with httpx.Client(timeout=30.0) as http:
        response = http.get(f"{base_url}/v1/cache/stats")
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats


def reset_courier_cache(base_url: str) -> None:
    with httpx.Client(timeout=30.0) as http:
        http.post(f"{base_url}/v1/cache/reset").raise_for_status()


# ---------------------------------------------------------------- one turn


def chat_turn(
    client: openai.OpenAI,
    model: str,
    messages: list[ChatCompletionMessageParam],
    *,
    max_tokens: int,
    user: str | None,
    conversation: int,
    turn: int,
) -> TurnResult:
    """Stream one completion; TTFT runs to the first content delta (to the finish chunk if none carries text)."""
    sent = time.perf_counter()
    first: float | None = None
    finish: float | None = None
    pieces: list[str] = []
    usage: CompletionUsage | None = None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        user=user if user is not None else openai.omit,
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
                first = now if first is None else first
            if choice.finish_reason is not None and finish is None:
                finish = now
    done = time.perf_counter()
    if usage is None:
        raise BenchmarkError(f"conversation {conversation} turn {turn}: the stream carried no usage")
    details = usage.prompt_tokens_details
    first_token = first if first is not None else (finish if finish is not None else done)
    return TurnResult(
        conversation=conversation,
        turn=turn,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=details.cached_tokens if details is not None else None,
        completion_tokens=usage.completion_tokens,
        ttft_s=first_token - sent,
        total_s=done - sent,
        empty_reply=first is None,
        reply="".join(pieces),
    )


def warm_up(client: openai.OpenAI, model: str) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": WARMUP_PROMPT}]
    chat_turn(client, model, messages, max_tokens=8, user="bench-warm-up", conversation=0, turn=0)


def check_deadline(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise BenchmarkError(f"{what}: stopped after the --run-timeout")


def later_turns(turns: Sequence[TurnResult]) -> list[TurnResult]:
    return [turn for turn in turns if turn.turn >= 2]


def cached_share(turns: Sequence[TurnResult]) -> float | None:
    later = later_turns(turns)
    if not later or any(turn.cached_tokens is None for turn in later):
        return None
    prompt = sum(turn.prompt_tokens for turn in later)
    return sum(turn.cached_tokens or 0 for turn in later) / prompt if prompt else None


def median_ttft(turns: Sequence[TurnResult]) -> float | None:
    return statistics.median(turn.ttft_s for turn in turns) if turns else None


# ---------------------------------------------------------------- part a: one long conversation


def user_message_a(turn: int) -> str:
    base = USER_MESSAGES_A[turn % len(USER_MESSAGES_A)]
    return base if turn < len(USER_MESSAGES_A) else f"{base} (question {turn + 1})"


def converse(
    base_url: str, spec: ServerSpec, turns: int, max_tokens: int, run_timeout_s: float
) -> tuple[list[TurnResult], dict[str, Any] | None]:
    """The conversation's turns, and Courier's cache stats after the last one."""
    deadline = time.monotonic() + run_timeout_s
    results: list[TurnResult] = []
    with make_client(base_url) as client:
        warm_up(client, spec.served_model)
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM_PROMPT_A}]
        for turn in range(turns):
            check_deadline(deadline, f"{spec.label} conversation")
            messages.append({"role": "user", "content": user_message_a(turn)})
            result = chat_turn(
                client, spec.served_model, messages, max_tokens=max_tokens, user=None, conversation=1, turn=turn + 1
            )
            results.append(result)
            messages.append({"role": "assistant", "content": result.reply})
    return results, courier_stats(base_url) if is_courier(spec.label) else None


def part_a_specs(
    labels: Sequence[str], dir4: Path, dir_f32: Path | None, courier_args: Sequence[str]
) -> list[ServerSpec]:
    specs: list[ServerSpec] = []
    for label in labels:
        if is_courier(label):
            specs.append(ServerSpec(label=label, model_dir=None, flags=tuple(courier_args)))
        elif label == MLX_LM_F32:
            specs.append(ServerSpec(label=MLX_LM_F32, model_dir=dir_f32, flags=("--log-level", "WARNING")))
        else:
            specs.append(ServerSpec(label=MLX_LM_4BIT, model_dir=dir4))
    return specs


def run_part_a(cache_dir: Path, dir4: Path, args: argparse.Namespace) -> list[ConversationRun]:
    dir_f32: Path | None = None
    if MLX_LM_F32 in args.a_servers:
        progress("dequantizing the 4-bit SmolLM2 directory to float32 for mlx-lm-f32")
        model, _ = load_float32(dir4)
        dir_f32 = save_float32_dir(model, dir4, cache_dir / "bench-models" / f"{COURIER_MODEL_ID}-float32")
        del model
        release_mlx_memory()
    runs: list[ConversationRun] = []
    for spec in part_a_specs(args.a_servers, dir4, dir_f32, args.courier_arg):

        def measure(base_url: str, spec: ServerSpec = spec) -> tuple[list[TurnResult], dict[str, Any] | None]:
            return converse(base_url, spec, args.turns, args.a_max_tokens, args.run_timeout)

        launch, result = serve_and_measure(spec, cache_dir, f"a-{spec.label}", args, measure)
        turns, stats = result if result is not None else ([], None)
        runs.append(ConversationRun(server=launch, turns=turns, courier_stats=stats))
    return runs


# ---------------------------------------------------------------- part b: K interleaved conversations


def system_prompt_b(k: int, index: int, handbook: str) -> str:
    return f"You are the support assistant for customer {index + 1} of {k}, account AC-{k:02d}{index:04d}. {handbook}"


def user_message_b(index: int, turn: int) -> str:
    return f"Message {turn + 1}: {QUESTIONS_B[(index + turn) % len(QUESTIONS_B)]}"


def handbook_words(count: int) -> str:
    """The first `count` words of HANDBOOK_B, repeated from its start when it is too short."""
    words = HANDBOOK_B.split()
    return " ".join(words[index % len(words)] for index in range(count))


def fewest_words(measure: Callable[[int], int], tokens: int) -> int:
    """The fewest handbook words whose text `measure`s at least `tokens` long."""
    low, high = 0, len(HANDBOOK_B.split())
    while measure(high) < tokens:
        high *= 2
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if measure(middle) < tokens else (low, middle)
    return low


def cut_handbook(tokenizer: Any, system_tokens: int) -> str:
    """HANDBOOK_B cut at a word (repeated when too short) so that a system prompt is about `system_tokens` long."""

    def measure(count: int) -> int:
        return len(tokenizer.encode(system_prompt_b(32, 31, handbook_words(count)), add_special_tokens=False))

    return handbook_words(fewest_words(measure, system_tokens))


def last_prompt_b(tokenizer: Any, handbook: str, args: argparse.Namespace, turns: int) -> list[int]:
    """A conversation's last prompt after `turns` turns, its replies stood in for by `--b-max-tokens` one-token
    words."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt_b(32, 0, handbook)}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": " ".join(["ok"] * args.b_max_tokens)})
        messages.append({"role": "user", "content": user_message_b(0, turn)})
    tokens: list[int] = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokens


def state_bytes(model: Any, tokens: Sequence[int]) -> int:
    """The bytes of mlx-lm's cache after `tokens`, contents only (a KV cache's growth buffer not counted)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([list(tokens)]), cache=cache)
    arrays: list[Any] = []
    for layer in cache:
        if isinstance(layer, KVCache):
            arrays += layer.keys_and_values()
        else:
            arrays += [value for _, value in tree_flatten(layer.state) if isinstance(value, mx.array)]
    mx.eval(arrays)
    return sum(array.nbytes for array in arrays)


def prepare_b(
    model: str,
    model_dir: Path,
    args: argparse.Namespace,
    *,
    states: int,
    turns: int,
    fixed_bytes: int | None,
    fixed_flag: str,
) -> tuple[str, ByteBudget]:
    """The handbook text for `--b-system-tokens`, and a byte budget: `states` model states of a conversation at
    its last prompt (after `turns` turns), weighed in this process on mlx-lm's own cache (or `fixed_bytes`, given
    by `fixed_flag`). Part b: `--budget-states` and `--b-turns`; part d: 8 and `--d-turns`."""
    from mlx_lm import load

    loaded, tokenizer = load(str(model_dir))
    handbook = cut_handbook(tokenizer, args.b_system_tokens)
    system = len(tokenizer.encode(system_prompt_b(32, 0, handbook), add_special_tokens=False))
    last = last_prompt_b(tokenizer, handbook, args, turns)
    one_state = state_bytes(loaded, last)
    del loaded
    release_mlx_memory()
    workload = (
        f"system prompt {system} tokens, last prompt of a conversation about {len(last)} tokens, one model state "
        f"there {one_state} B (mlx-lm cache contents)"
    )
    if fixed_bytes is not None:
        return handbook, ByteBudget(model=model, capacity_bytes=fixed_bytes, explanation=f"{fixed_flag}; {workload}")
    capacity = states * one_state
    explanation = f"{states} model states of {one_state} B; {workload}"
    return handbook, ByteBudget(model=model, capacity_bytes=capacity, explanation=explanation)


History = list[ChatCompletionMessageParam]


def histories_b(k: int, handbook: str) -> list[History]:
    """K conversations, each its system prompt so far."""
    return [[{"role": "system", "content": system_prompt_b(k, index, handbook)}] for index in range(k)]


def interleaved_round(
    client: openai.OpenAI, model: str, histories: Sequence[History], turn: int, *, k: int, max_tokens: int
) -> list[TurnResult]:
    """Turn `turn` (from 0) of every conversation, in order, each as its own `user`; each reply joins its history."""
    results: list[TurnResult] = []
    for index, messages in enumerate(histories):
        messages.append({"role": "user", "content": user_message_b(index, turn)})
        result = chat_turn(
            client,
            model,
            messages,
            max_tokens=max_tokens,
            user=f"k{k}-conversation-{index + 1}",
            conversation=index + 1,
            turn=turn + 1,
        )
        results.append(result)
        messages.append({"role": "assistant", "content": result.reply})
    return results


def interleave(
    base_url: str,
    spec: ServerSpec,
    k: int,
    handbook: str,
    args: argparse.Namespace,
    *,
    turns: int,
    settle: bool = False,
) -> list[TurnResult]:
    """K fresh conversations, `turns` turns each, interleaved turn by turn, after a warm-up request (and, on
    Courier, a cache reset that forgets it; with `settle` only once Courier is idle, or the warm-up request's own
    idle warm-up may land after the reset)."""
    deadline = time.monotonic() + args.run_timeout
    histories = histories_b(k, handbook)
    results: list[TurnResult] = []
    with make_client(base_url) as client:
        warm_up(client, spec.served_model)
        if is_courier(spec.label):
            if settle:
                wait_until_idle(base_url)
            reset_courier_cache(base_url)
        for turn in range(turns):
            check_deadline(deadline, f"{spec.label} K={k}")
            results += interleaved_round(client, spec.served_model, histories, turn, k=k, max_tokens=args.b_max_tokens)
    return results


def part_b_spec(
    label: str, model_dir: Path, budget: str, budget_bytes: int | None, args: argparse.Namespace
) -> ServerSpec:
    if is_courier(label):
        flags = list(args.courier_arg)
        if budget == EQUAL_BUDGET:
            flags += ["--prompt-cache-snapshot-capacity-bytes", str(budget_bytes)]
        return ServerSpec(label=label, model_dir=model_dir, flags=tuple(flags))
    flags = ["--log-level", "WARNING"]
    if budget == ANCHOR_BUDGET:
        flags += ["--prompt-cache-size", str(ANCHOR_CACHE_SIZE)]
    elif budget == EQUAL_BUDGET:
        flags += ["--prompt-cache-bytes", str(budget_bytes), "--prompt-cache-size", str(COURIER_DEFAULT_MAX_ENTRIES)]
    return ServerSpec(label=MLX_LM_F32, model_dir=model_dir, flags=tuple(flags))


def warm_turns(turns: Sequence[TurnResult]) -> float | None:
    """The share of turns 2+ served from the state the conversation's previous turn left: at least its whole
    previous prompt but the generation prompt came from the cache (a system prompt alone does not count)."""
    previous: dict[int, TurnResult] = {}
    warm = counted = 0
    for turn in sorted(turns, key=lambda item: (item.conversation, item.turn)):
        before = previous.get(turn.conversation)
        previous[turn.conversation] = turn
        if before is None or turn.cached_tokens is None:
            continue
        counted += 1
        warm += turn.cached_tokens >= before.prompt_tokens - GENERATION_PROMPT_TOKENS
    return warm / counted if counted else None


def run_interleaved(
    cache_dir: Path,
    *,
    model: str,
    model_dir: Path,
    label: str,
    k: int,
    budget: str,
    budget_bytes: int | None,
    handbook: str,
    args: argparse.Namespace,
) -> InterleavedRun:
    spec = part_b_spec(label, model_dir, budget, budget_bytes, args)

    def measure(base_url: str) -> tuple[list[TurnResult], dict[str, Any] | None]:
        turns = interleave(base_url, spec, k, handbook, args, turns=args.b_turns)
        return turns, courier_stats(base_url) if is_courier(label) else None

    log_name = f"b-{model}-{label}-{budget}-k{k}"
    launch, result = serve_and_measure(spec, cache_dir, log_name, args, measure)
    turns, stats = result if result is not None else ([], None)
    later = later_turns(turns)
    share = cached_share(turns)
    extra = ""
    if stats is not None:
        keys = ("snapshot_entries", "snapshot_evictions_lru", "snapshot_self_evictions", "snapshot_bytes_per_entry")
        extra = "".join(f", {key} {stats.get(key)}" for key in keys)
    progress(f"{log_name}: cached share {share_text(share)}, warm turns {share_text(warm_turns(turns))}{extra}")
    return InterleavedRun(
        model=model,
        budget=budget,
        budget_bytes=budget_bytes if budget == EQUAL_BUDGET else None,
        conversations=k,
        server=launch,
        cached_share=share,
        warm_turns=warm_turns(turns),
        ttft_p50_later_s=median_ttft(later),
        ttft_p50_first_s=median_ttft([turn for turn in turns if turn.turn == 1]),
        empty_replies=sum(turn.empty_reply for turn in turns),
        courier_stats=stats,
        turns=turns,
    )


def held_warm(model: str, runs: Sequence[InterleavedRun], label: str) -> HeldWarm:
    """The largest swept K up to which `label`'s share at the equal budget stays >= WARM_FRACTION of its share with
    an unconstrained cache (Courier's default, mlx_lm.server's --prompt-cache-size 100) at K=REFERENCE_K."""
    unconstrained = DEFAULT_BUDGET if is_courier(label) else ANCHOR_BUDGET
    reference = next(
        (
            r.cached_share
            for r in runs
            if (r.server.label, r.budget, r.conversations) == (label, unconstrained, REFERENCE_K)
        ),
        None,
    )
    swept = sorted(
        (r for r in runs if r.server.label == label and r.budget == EQUAL_BUDGET), key=lambda r: r.conversations
    )
    if reference is None or not swept:
        return HeldWarm(model=model, server=label, reference_share=reference, threshold=None, conversations=None)
    threshold = WARM_FRACTION * reference
    conversations = 0
    for run in swept:
        if run.cached_share is None or run.cached_share < threshold:
            break
        conversations = run.conversations
    at_least = conversations == swept[-1].conversations
    return HeldWarm(
        model=model,
        server=label,
        reference_share=reference,
        threshold=threshold,
        conversations=conversations,
        at_least=at_least,
    )


def build_tiny_model(model: str, tokenizer_dir: Path, cache_dir: Path) -> Path:
    from tests.support.tiny_models import build_llama, build_qwen3_next

    target = cache_dir / "bench-models" / f"tiny-{model}"
    if model == "llama":
        return build_llama(tokenizer_dir, target, quantized=False)
    return build_qwen3_next(tokenizer_dir, target)


def server_groups(labels: Sequence[str]) -> list[list[str]]:
    """Servers whose runs alternate K by K: the two Courier servers (in the order given) form one group, so drift on a
    noisy machine hits both alike; every other server is a group of its own."""
    groups: list[list[str]] = []
    for label in in_run_order(labels):
        if is_courier(label) and groups and is_courier(groups[-1][0]):
            groups[-1].append(label)  # in_run_order put the two next to each other
        else:
            groups.append([label])
    return groups


def part_b_plan(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(budget, server, K) of every run, in order: defaults, the size-100 anchor, then the equal-budget sweep."""
    plan: list[tuple[str, str, int]] = []
    for budget in args.b_budgets:
        labels = [label for label in args.b_servers if budget != ANCHOR_BUDGET or label == MLX_LM_F32]
        ks = args.equal_conversations if budget == EQUAL_BUDGET else args.conversations
        plan += [(budget, label, k) for group in server_groups(labels) for k in ks for label in group]
    return plan


def run_part_b(
    cache_dir: Path, dir4: Path, args: argparse.Namespace
) -> tuple[list[InterleavedRun], list[ByteBudget], list[HeldWarm]]:
    runs: list[InterleavedRun] = []
    budgets: list[ByteBudget] = []
    held: list[HeldWarm] = []
    for model in args.b_models:
        model_dir = build_tiny_model(model, dir4, cache_dir)
        handbook, budget = prepare_b(
            model,
            model_dir,
            args,
            states=args.budget_states,
            turns=args.b_turns,
            fixed_bytes=args.budget_bytes,
            fixed_flag="--budget-bytes",
        )
        progress(f"tiny {model} model: {model_dir}; equal byte budget {budget.capacity_bytes} B ({budget.explanation})")
        model_runs = [
            run_interleaved(
                cache_dir,
                model=model,
                model_dir=model_dir,
                label=label,
                k=k,
                budget=name,
                budget_bytes=budget.capacity_bytes,
                handbook=handbook,
                args=args,
            )
            for name, label, k in part_b_plan(args)
        ]
        runs += model_runs
        if EQUAL_BUDGET in args.b_budgets:
            budgets.append(budget)
            held += [held_warm(model, model_runs, label) for label in args.b_servers]
    return runs, budgets, held


# ---------------------------------------------------------------- part c: store latency


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreWorkload:
    """Every token vector of part c, made before anything is timed."""

    vectors: list[tuple[int, ...]]
    sessions: list[str]
    lookups: dict[str, list[tuple[str, tuple[int, ...], int]]]  # kind -> (session, tokens, least matched; 0: miss)


def make_workload(entries: int, sessions: int, lookups: int, seed: int) -> StoreWorkload:
    rng = random.Random(seed)
    vocab = list(range(STORE_VOCAB))  # shared int objects keep the vectors' memory at a pointer per token
    prefix = tuple(rng.choices(vocab, k=STORE_PREFIX_TOKENS))
    low, high = STORE_SUFFIX_TOKENS
    vectors = [prefix + tuple(rng.choices(vocab, k=rng.randint(low, high))) for _ in range(entries)]
    names = [f"user-{index % sessions}" for index in range(entries)]
    next_turns: list[tuple[str, tuple[int, ...], int]] = []
    for _ in range(lookups):
        index = rng.randrange(entries)
        tokens = vectors[index] + tuple(rng.choices(vocab, k=STORE_NEXT_TURN_TOKENS))
        next_turns.append((names[index], tokens, len(vectors[index])))
    shared = [
        (f"new-{index}", prefix + tuple(rng.choices(vocab, k=STORE_NEW_CONVERSATION_TOKENS)), STORE_PREFIX_TOKENS)
        for index in range(lookups)
    ]
    others = [token for token in vocab if token != prefix[0]]
    misses = [
        (f"new-{index}", (rng.choice(others), *rng.choices(vocab, k=STORE_MISS_TOKENS - 1)), 0)
        for index in range(lookups)
    ]
    kinds = {LOOKUP_NEXT_TURN: next_turns, LOOKUP_SHARED_PREFIX: shared, LOOKUP_MISS: misses}
    return StoreWorkload(vectors=vectors, sessions=names, lookups=kinds)


def summarize(operation: str, samples_ns: Sequence[int], unexpected: int) -> LatencySummary:
    micros = [sample / 1000 for sample in samples_ns]
    return LatencySummary(
        operation=operation,
        count=len(micros),
        p50_us=percentile(micros, 0.50),
        p99_us=percentile(micros, 0.99),
        max_us=max(micros),
        unexpected=unexpected,
    )


def measure_store(args: argparse.Namespace) -> StoreLatencyResult:
    from courier.core.snapshot_store import Bucket, Origin, SnapshotStore, StoreLimits

    progress(f"store: making {args.store_entries} vectors and {args.store_lookups} lookups of each kind")
    workload = make_workload(args.store_entries, args.store_sessions, args.store_lookups, args.seed)
    limits = StoreLimits(
        capacity_bytes=1 << 62, max_entries=2 * args.store_entries, ttl_s=1e9, min_prefix=STORE_MIN_PREFIX
    )
    store = SnapshotStore(limits, trimmable=True, clock=time.monotonic)
    bucket = Bucket("m")
    gc.collect()
    insert_ns: list[int] = []
    build_started = time.perf_counter()
    for session, tokens in zip(workload.sessions, workload.vectors, strict=True):
        started = time.perf_counter_ns()
        store.insert(bucket=bucket, session=session, origin=Origin.COMPLETION, tokens=tokens, state=None, nbytes=1)
        insert_ns.append(time.perf_counter_ns() - started)
    build_s = time.perf_counter() - build_started
    progress(f"store: {store.entries} entries inserted in {build_s:.1f} s; timing lookups")
    operations = [summarize(f"insert (store growing to {store.entries})", insert_ns, 0)]
    for kind, queries in workload.lookups.items():
        samples: list[int] = []
        unexpected = 0
        for session, tokens, expected in queries:
            started = time.perf_counter_ns()
            result = store.lookup(bucket, session, tokens)
            samples.append(time.perf_counter_ns() - started)
            # A hit must reach at least its expected length (a new suffix may match a stored token by chance).
            unexpected += result.matched < expected if expected else result.matched != 0
        operations.append(summarize(kind, samples, unexpected))
    return StoreLatencyResult(
        entries=store.entries,
        sessions=args.store_sessions,
        prefix_tokens=STORE_PREFIX_TOKENS,
        suffix_tokens=STORE_SUFFIX_TOKENS,
        build_s=build_s,
        operations=operations,
    )


# ---------------------------------------------------------------- part d: the disk tier


def fresh_prompt_dir(cache_dir: Path, name: str) -> Path:
    """An empty directory for one Courier run's `--prompt-cache-dir` (deleted by the caller afterwards)."""
    root = cache_dir / "bench-prompt-cache"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))


def disk_spec(
    label: str, model_dir: Path | None, budget_bytes: int, prompt_dir: Path | None, args: argparse.Namespace
) -> ServerSpec:
    """Courier with the memory budget, `--d-disk-bytes` of disk tier and its own directory; mlx_lm.server as at
    part b's equal budget (`--prompt-cache-bytes B --prompt-cache-size 4096`)."""
    if is_courier(label):
        flags = [
            *args.courier_arg,
            *("--prompt-cache-snapshot-capacity-bytes", str(budget_bytes)),
            *("--prompt-cache-disk-bytes", str(args.d_disk_bytes)),
            *("--prompt-cache-dir", str(prompt_dir)),
        ]
        return ServerSpec(label=label, model_dir=model_dir, flags=tuple(flags))
    assert model_dir is not None, "mlx_lm.server needs a model directory"
    return part_b_spec(MLX_LM_F32, model_dir, EQUAL_BUDGET, budget_bytes, args)


def is_idle(stats: dict[str, Any]) -> bool:
    return bool(stats.get("snapshot_warmups_pending", 0) == 0 and stats.get("snapshot_disk_pending", 0) == 0)


def wait_until_idle(base_url: str, timeout_s: float = IDLE_TIMEOUT_S) -> tuple[dict[str, Any], float]:
    """Poll `/v1/cache/stats` until Courier has nothing left to do for its cache: no warm-up queued or running
    (`snapshot_warmups_pending` 0), no disk write or delete queued or under way (`snapshot_disk_pending` 0), and
    IDLE_COUNTERS (warm-ups queued, run and skipped, inserts, disk writes and writes skipped) unchanged since the
    previous poll, IDLE_POLL_S earlier. Returns the last stats and the seconds it took."""
    started = time.monotonic()
    previous: tuple[Any, ...] | None = None
    with httpx.Client(timeout=30.0) as http:
        while True:
            response = http.get(f"{base_url}/v1/cache/stats")
            response.raise_for_status()
            stats: dict[str, Any] = response.json()
            counters = tuple(stats.get(key) for key in IDLE_COUNTERS)
            if is_idle(stats) and counters == previous:
                return stats, time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise BenchmarkError(f"Courier not idle after {timeout_s:.0f} s: {stats}")
            previous = counters if is_idle(stats) else None
            time.sleep(IDLE_POLL_S)


def disk_stats_text(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return ""
    keys = (
        *("snapshot_memory_entries", "snapshot_disk_entries", "snapshot_disk_hits", "snapshot_spills"),
        *("snapshot_disk_restores", "snapshot_disk_adopted", "snapshot_lookups_timed_out"),
        *("snapshot_disk_read_errors", "snapshot_disk_writes_refused", "snapshot_disk_restores_refused"),
    )
    return "".join(f", {key} {stats.get(key)}" for key in keys)


def run_disk(
    cache_dir: Path,
    *,
    model: str,
    model_dir: Path,
    label: str,
    k: int,
    budget_bytes: int,
    handbook: str,
    args: argparse.Namespace,
) -> DiskRun:
    """Part d1: one (server, model, K)."""
    log_name = f"d1-{model}-{label}-k{k}"
    prompt_dir = fresh_prompt_dir(cache_dir, log_name) if is_courier(label) else None
    spec = disk_spec(label, model_dir, budget_bytes, prompt_dir, args)

    def measure(base_url: str) -> tuple[list[TurnResult], float, dict[str, Any] | None]:
        started = time.monotonic()
        turns = interleave(base_url, spec, k, handbook, args, turns=args.d_turns, settle=True)
        measure_s = time.monotonic() - started
        return turns, measure_s, wait_until_idle(base_url)[0] if is_courier(label) else None

    started = time.monotonic()
    try:
        launch, result = serve_and_measure(spec, cache_dir, log_name, args, measure)
    finally:
        if prompt_dir is not None:
            shutil.rmtree(prompt_dir, ignore_errors=True)
    wall_s = time.monotonic() - started
    turns, measure_s, stats = result if result is not None else ([], None, None)
    share, warm = cached_share(turns), warm_turns(turns)
    progress(
        f"{log_name}: cached share {share_text(share)}, warm turns {share_text(warm)}, {wall_s:.0f} s"
        f"{disk_stats_text(stats)}"
    )
    return DiskRun(
        model=model,
        conversations=k,
        budget_bytes=budget_bytes,
        disk_bytes=args.d_disk_bytes if is_courier(label) else None,
        server=launch,
        cached_share=share,
        warm_turns=warm,
        ttft_p50_later_s=median_ttft(later_turns(turns)),
        ttft_p50_first_s=median_ttft([turn for turn in turns if turn.turn == 1]),
        empty_replies=sum(turn.empty_reply for turn in turns),
        measure_s=measure_s,
        wall_s=wall_s,
        courier_stats=stats,
        turns=turns,
    )


def run_restart(
    cache_dir: Path,
    *,
    model: str,
    model_dir: Path,
    label: str,
    stop: signal.Signals,
    budget_bytes: int,
    handbook: str,
    args: argparse.Namespace,
) -> RestartRun:
    """Part d2: K conversations, `stop`, a restart on the same directory, one more turn of each conversation.

    SIGTERM comes right after the last reply (a clean stop must flush what it holds itself); SIGKILL only once
    Courier is idle (`wait_until_idle`), so that it measures what write-behind kept, not a race with it."""
    k = args.d_restart_conversations
    log_name = f"d2-{model}-{label}-k{k}-{stop.name}"
    courier = is_courier(label)
    prompt_dir = fresh_prompt_dir(cache_dir, log_name) if courier else None
    spec = disk_spec(label, model_dir, budget_bytes, prompt_dir, args)
    histories = histories_b(k, handbook)

    def before(base_url: str) -> tuple[list[TurnResult], float | None, dict[str, Any] | None]:
        deadline = time.monotonic() + args.run_timeout
        turns: list[TurnResult] = []
        with make_client(base_url) as client:
            warm_up(client, spec.served_model)
            if courier:
                wait_until_idle(base_url)
                reset_courier_cache(base_url)
            for turn in range(args.d_turns):
                check_deadline(deadline, f"{log_name}, before the stop")
                turns += interleaved_round(
                    client, spec.served_model, histories, turn, k=k, max_tokens=args.b_max_tokens
                )
        if not courier:
            return turns, None, None
        if stop == signal.SIGKILL:
            stats, idle_s = wait_until_idle(base_url)
            return turns, idle_s, stats
        return turns, None, courier_stats(base_url)

    def after(base_url: str) -> tuple[list[TurnResult], dict[str, Any] | None, dict[str, Any] | None]:
        at_start = courier_stats(base_url) if courier else None
        with make_client(base_url) as client:
            warm_up(client, spec.served_model)
            turns = interleaved_round(
                client, spec.served_model, histories, args.d_turns, k=k, max_tokens=args.b_max_tokens
            )
        return turns, at_start, wait_until_idle(base_url)[0] if courier else None

    try:
        first, measured = serve_and_measure(spec, cache_dir, f"{log_name}-1", args, before, stop_signal=stop)
        turns_before, idle_s, at_stop = measured if measured is not None else ([], None, None)
        second: ServerLaunch | None = None
        turns_after: list[TurnResult] = []
        at_start = at_end = None
        if measured is not None:
            second, resumed = serve_and_measure(spec, cache_dir, f"{log_name}-2", args, after)
            turns_after, at_start, at_end = resumed if resumed is not None else ([], None, None)
    finally:
        if prompt_dir is not None:
            shutil.rmtree(prompt_dir, ignore_errors=True)
    last_before = [turn for turn in turns_before if turn.turn == args.d_turns]
    share_after = cached_share(turns_after)
    adopted = None if at_start is None else at_start.get("snapshot_disk_adopted")
    progress(f"{log_name}: next turns after the restart: cached share {share_text(share_after)}, adopted {adopted}")
    return RestartRun(
        model=model,
        label=label,
        conversations=k,
        stop=stop.name,
        before=first,
        after=second,
        idle_wait_s=idle_s,
        stats_at_stop=at_stop,
        stats_at_start=at_start,
        stats_after=at_end,
        cached_share_before=cached_share(turns_before),
        cached_share_after=share_after,
        warm_after=warm_turns(last_before + turns_after),
        ttft_p50_after_s=median_ttft(turns_after),
        turns_before=turns_before,
        turns_after=turns_after,
    )


def d3_conversation(customer: int, words: str) -> History:
    """d3's conversation: a long system prompt, three exchanges written out, and the question to answer."""
    system = f"You are the support assistant for customer {customer}, account AC-{customer:06d}. {words}"
    messages: History = [{"role": "system", "content": system}]
    for question, answer in D3_EXCHANGES:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": D3_QUESTION})
    return messages


def d3_words(tokenizer: Any, tokens: int) -> str:
    """The handbook words that make d3's prompt (chat template and generation prompt included) `tokens` long."""

    def measure(count: int) -> int:
        messages = d3_conversation(D3_TARGET_CUSTOMER, handbook_words(count))
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    return handbook_words(fewest_words(measure, tokens))


def stats_gained(before: dict[str, Any] | None, after: dict[str, Any] | None, key: str) -> int | None:
    if before is None or after is None:
        return None
    return int(after.get(key, 0)) - int(before.get(key, 0))


def ttft_sample(
    kind: str, repeat: int, result: TurnResult, before: dict[str, Any] | None, after: dict[str, Any] | None
) -> TtftSample:
    """A timed request, verified: a cold one found (almost) nothing cached; a hit found at least the whole history
    (the prompt but its generation prompt) cached, a disk hit with `snapshot_disk_hits` grown on it, a memory hit
    with `snapshot_memory_hits` grown and `snapshot_disk_hits` not (stats are Courier's: mlx_lm.server's hits are
    verified by cached_tokens alone)."""
    cached = result.cached_tokens or 0
    disk_hits = stats_gained(before, after, "snapshot_disk_hits")
    memory_hits = stats_gained(before, after, "snapshot_memory_hits")
    whole = cached >= result.prompt_tokens - GENERATION_PROMPT_TOKENS
    if kind in (COLD, FILLER):
        verified = cached <= COLD_CACHED_SLACK
    elif kind == DISK_HIT:
        verified = whole and disk_hits is not None and disk_hits >= 1
    elif before is None:
        verified = whole
    else:
        verified = whole and not disk_hits and bool(memory_hits)
    return TtftSample(
        kind=kind,
        repeat=repeat,
        ttft_s=result.ttft_s,
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        disk_hits=disk_hits,
        memory_hits=memory_hits,
        restores=stats_gained(before, after, "snapshot_disk_restores"),
        lookups_timed_out=stats_gained(before, after, "snapshot_lookups_timed_out"),
        verified=verified,
    )


def probe_entry(
    cache_dir: Path, target: History, args: argparse.Namespace
) -> tuple[ServerLaunch, dict[str, Any] | None]:
    """Courier, memory only (`--prompt-cache-disk-bytes 0`) at its default budget, after d3's prompt once and its
    idle warm-up: the conversation alone in the store (`snapshot_bytes_per_entry`: its snapshot at rest)."""
    spec = ServerSpec(label=COURIER, model_dir=None, flags=(*args.courier_arg, "--prompt-cache-disk-bytes", "0"))

    def measure(base_url: str) -> dict[str, Any]:
        with make_client(base_url) as client:
            warm_up(client, spec.served_model)
            wait_until_idle(base_url)
            reset_courier_cache(base_url)
            chat_turn(
                client,
                spec.served_model,
                target,
                max_tokens=args.d_ttft_max_tokens,
                user=D3_TARGET_USER,
                conversation=1,
                turn=1,
            )
        stats, _ = wait_until_idle(base_url)
        progress(
            f"d3 probe: {stats.get('snapshot_entries')} entries, {stats.get('snapshot_bytes')} B, "
            f"{stats.get('snapshot_bytes_per_entry')} B an entry"
        )
        return stats

    return serve_and_measure(spec, cache_dir, "d3-courier-probe", args, measure)


def courier_ttft(cache_dir: Path, target: History, filler: History, args: argparse.Namespace) -> DiskTtft:
    """d3 on Courier: per repeat, reset, the target prompt cold; the filler conversation cold (its snapshots push
    the target's out of memory); the target prompt again (a disk hit); and once more (a memory hit). Courier is
    idle before every timed request and before every reset."""
    probe: ServerLaunch | None = None
    probe_stats: dict[str, Any] | None = None
    entry: int | None = None
    capacity = args.d_ttft_capacity_bytes
    if capacity is None:
        probe, probe_stats = probe_entry(cache_dir, target, args)
        entry = int(probe_stats.get("snapshot_bytes_per_entry", 0)) if probe_stats is not None else None
        if not entry:
            failed = probe.error or "no snapshot held"
            launch = ServerLaunch(label=COURIER, command=[], extra_env={}, error=f"probe failed: {failed}")
            return DiskTtft(
                server=launch,
                probe=probe,
                probe_stats=probe_stats,
                entry_bytes=entry,
                capacity_bytes=None,
                samples=[],
                courier_stats=None,
            )
        capacity = int(entry * D3_CAPACITY_ENTRIES)
    prompt_dir = fresh_prompt_dir(cache_dir, "d3-courier")
    spec = disk_spec(COURIER, None, capacity, prompt_dir, args)

    def measure(base_url: str) -> tuple[list[TtftSample], dict[str, Any]]:
        deadline = time.monotonic() + args.run_timeout
        samples: list[TtftSample] = []
        with make_client(base_url) as client:

            def timed(kind: str, repeat: int, messages: History, user: str) -> None:
                before, _ = wait_until_idle(base_url)
                result = chat_turn(
                    client,
                    spec.served_model,
                    messages,
                    max_tokens=args.d_ttft_max_tokens,
                    user=user,
                    conversation=1,
                    turn=1,
                )
                sample = ttft_sample(kind, repeat, result, before, courier_stats(base_url))
                samples.append(sample)
                progress(
                    f"d3 courier #{repeat + 1} {kind}: TTFT {ms(sample.ttft_s)} ms, prompt {sample.prompt_tokens}, "
                    f"cached {sample.cached_tokens}, disk hits +{sample.disk_hits}, memory hits +{sample.memory_hits}, "
                    f"restores +{sample.restores}, lookups timed out +{sample.lookups_timed_out}, "
                    f"verified {sample.verified}"
                )

            warm_up(client, spec.served_model)
            for repeat in range(args.d_ttft_repeats):
                check_deadline(deadline, "d3 courier")
                wait_until_idle(base_url)
                reset_courier_cache(base_url)
                timed(COLD, repeat, target, D3_TARGET_USER)
                timed(FILLER, repeat, filler, D3_FILLER_USER)
                timed(DISK_HIT, repeat, target, D3_TARGET_USER)
                timed(MEMORY_HIT, repeat, target, D3_TARGET_USER)
        return samples, courier_stats(base_url)

    try:
        launch, result = serve_and_measure(spec, cache_dir, "d3-courier", args, measure)
    finally:
        shutil.rmtree(prompt_dir, ignore_errors=True)
    samples, stats = result if result is not None else ([], None)
    return DiskTtft(
        server=launch,
        probe=probe,
        probe_stats=probe_stats,
        entry_bytes=entry,
        capacity_bytes=capacity,
        samples=samples,
        courier_stats=stats,
    )


def mlx_ttft(cache_dir: Path, dir4: Path, words: str, args: argparse.Namespace) -> DiskTtft:
    """d3's context on mlx_lm.server (float32 SmolLM2, as part a): per repeat, a prompt like Courier's but for
    another customer (so nothing but a few template tokens is cached: cold), then the same prompt again (a memory
    hit). It has no disk tier."""
    progress("dequantizing the 4-bit SmolLM2 directory to float32 for mlx-lm-f32")
    model, _ = load_float32(dir4)
    dir_f32 = save_float32_dir(model, dir4, cache_dir / "bench-models" / f"{COURIER_MODEL_ID}-float32")
    del model
    release_mlx_memory()
    spec = ServerSpec(label=MLX_LM_F32, model_dir=dir_f32, flags=("--log-level", "WARNING"))

    def measure(base_url: str) -> list[TtftSample]:
        deadline = time.monotonic() + args.run_timeout
        samples: list[TtftSample] = []
        with make_client(base_url) as client:
            warm_up(client, spec.served_model)
            for repeat in range(args.d_ttft_repeats):
                check_deadline(deadline, "d3 mlx_lm.server")
                messages = d3_conversation(D3_MLX_CUSTOMERS + repeat, words)
                for kind in (COLD, MEMORY_HIT):
                    result = chat_turn(
                        client,
                        spec.served_model,
                        messages,
                        max_tokens=args.d_ttft_max_tokens,
                        user=None,
                        conversation=1,
                        turn=1,
                    )
                    samples.append(ttft_sample(kind, repeat, result, None, None))
                    progress(f"d3 mlx-lm-f32 #{repeat + 1} {kind}: TTFT {ms(result.ttft_s)} ms")
        return samples

    launch, samples = serve_and_measure(spec, cache_dir, "d3-mlx-lm-f32", args, measure)
    return DiskTtft(
        server=launch,
        probe=None,
        probe_stats=None,
        entry_bytes=None,
        capacity_bytes=None,
        samples=samples or [],
        courier_stats=None,
    )


def run_part_d1_d2(
    cache_dir: Path, dir4: Path, args: argparse.Namespace, wall: dict[str, float]
) -> tuple[list[ByteBudget], list[DiskRun], list[RestartRun]]:
    budgets: list[ByteBudget] = []
    runs: list[DiskRun] = []
    restarts: list[RestartRun] = []
    for model in args.d_models:
        model_dir = build_tiny_model(model, dir4, cache_dir)
        handbook, budget = prepare_b(
            model,
            model_dir,
            args,
            states=args.d_budget_conversations,
            turns=args.d_turns,
            fixed_bytes=args.d_budget_bytes,
            fixed_flag="--d-budget-bytes",
        )
        budgets.append(budget)
        progress(f"tiny {model} model: {model_dir}; part d memory budget {budget.capacity_bytes} B")
        shared = {"model": model, "model_dir": model_dir, "budget_bytes": budget.capacity_bytes, "handbook": handbook}
        if "1" in args.d_sections:
            started = time.monotonic()
            for k in args.d_conversations:
                runs += [run_disk(cache_dir, label=label, k=k, args=args, **shared) for label in args.d_servers]
            wall[f"d1 {model}"] = time.monotonic() - started
        if "2" in args.d_sections:
            started = time.monotonic()
            for label in args.d_servers:
                # mlx_lm.server keeps nothing across a restart, however it stops: one clean stop shows it.
                stops = args.d_restart_signals if is_courier(label) else args.d_restart_signals[:1]
                restarts += [run_restart(cache_dir, label=label, stop=stop, args=args, **shared) for stop in stops]
            wall[f"d2 {model}"] = time.monotonic() - started
    return budgets, runs, restarts


def run_part_d(cache_dir: Path, dir4: Path, args: argparse.Namespace) -> DiskTierResult:
    wall: dict[str, float] = {}
    budgets, runs, restarts = run_part_d1_d2(cache_dir, dir4, args, wall)
    ttft: list[DiskTtft] = []
    if "3" in args.d_sections:
        from mlx_lm.utils import load_tokenizer

        started = time.monotonic()
        words = d3_words(load_tokenizer(dir4), args.d_history_tokens)
        target = d3_conversation(D3_TARGET_CUSTOMER, words)
        filler = d3_conversation(D3_FILLER_CUSTOMER, words)
        if COURIER in args.d_servers:
            ttft.append(courier_ttft(cache_dir, target, filler, args))
        if MLX_LM_F32 in args.d_servers:
            ttft.append(mlx_ttft(cache_dir, dir4, words, args))
        wall["d3"] = time.monotonic() - started
    return DiskTierResult(
        budget_conversations=args.d_budget_conversations,
        budgets=budgets,
        runs=runs,
        restarts=restarts,
        ttft=ttft,
        wall_s=wall,
    )


# ---------------------------------------------------------------- report


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"


def share_text(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.1%}"


def command_text(launch: ServerLaunch) -> str:
    """The command with its port written as PORT, so runs that differ only there print alike."""
    words = list(launch.command)
    for flag, stand_in in (("--port", "PORT"), ("--prompt-cache-dir", "DIR")):
        if flag in words:
            words[words.index(flag) + 1] = stand_in
    env_text = " ".join(f"{key}={value}" for key, value in launch.extra_env.items())
    return (env_text + " " if env_text else "") + shlex.join(words)


def print_report(report: Report) -> None:
    env = report.environment
    print("## Courier multi-turn benchmark\n")
    print(f"- python {env['python']}, mlx {env['mlx']}, mlx-lm {env['mlx-lm']}, courier {env['courier']}")
    print(f"- machine: {env['platform']} ({env['machine']}, {env['processor']}), {env['cpu_count']} CPUs")
    print(f"- settings: {report.settings}\n")
    if report.conversation:
        print_part_a(report.conversation)
    if report.interleaved:
        print_part_b(report.interleaved, report.budgets, report.held_warm)
    if report.store is not None:
        print_part_c(report.store)
    if report.disk_tier is not None:
        print_part_d(report.disk_tier)


def print_launches(launches: Sequence[ServerLaunch]) -> None:
    seen: set[str] = set()
    for launch in launches:
        text = command_text(launch)
        if text not in seen:
            seen.add(text)
            print(f"- `{launch.label}`: `{text}`")
    for launch in launches:
        if launch.error is not None:
            print(f"- FAILED `{launch.label}` ({command_text(launch)}): {launch.error.splitlines()[0]}")
    print()


def turn_cells(run: ConversationRun, turn: int) -> str:
    result = next((item for item in run.turns if item.turn == turn), None)
    if result is None:
        return " | | |"
    cached = "n/a" if result.cached_tokens is None else str(result.cached_tokens)
    return f" {ms(result.ttft_s)} | {result.prompt_tokens} | {cached} |"


def print_part_a(runs: Sequence[ConversationRun]) -> None:
    print("### (a) One conversation, ~300-token system prompt, SmolLM2-135M-Instruct\n")
    print_launches([run.server for run in runs])
    header = "| turn |" + "".join(f" {run.server.label} TTFT ms | prompt | cached |" for run in runs)
    print(header)
    print("|---|" + "---|---|---|" * len(runs))
    for turn in range(1, 1 + max((len(run.turns) for run in runs), default=0)):
        print(f"| {turn} |" + "".join(turn_cells(run, turn) for run in runs))
    summary = "".join(
        f" {ms(median_ttft(later_turns(run.turns)))} | | {share_text(cached_share(run.turns))} |" for run in runs
    )
    print(f"| p50 / share, turns 2+ |{summary}\n")
    ours = next((run for run in runs if run.server.label == COURIER), None)
    theirs = next((run for run in runs if run.server.label == COURIER_BASELINE), None)
    if ours is not None and theirs is not None:
        print(baseline_line("", ours.turns, theirs.turns))
    for run in runs:
        if run.courier_stats is not None:
            keys = ("snapshot_entries", "snapshot_hits", "snapshot_lookups", "snapshot_supersedes", "tokens_reused")
            print(
                f"- {run.server.label} cache stats: " + ", ".join(f"{key} {run.courier_stats.get(key)}" for key in keys)
            )
    print()


def ratio_text(ours: float | None, theirs: float | None, show: Callable[[float | None], str]) -> str:
    """Both figures and their ratio, as in "97.1% / 97.0% = 1.001x"."""
    ratio = "n/a" if ours is None or not theirs else f"{ours / theirs:.3f}x"
    return f"{show(ours)} / {show(theirs)} = {ratio}"


def baseline_line(where: str, ours: Sequence[TurnResult], theirs: Sequence[TurnResult]) -> str:
    """The "courier / courier-baseline" line: cached share (above 1 favours courier) and TTFT p50 (below 1 does) of
    turns 2+."""
    shares = ratio_text(cached_share(ours), cached_share(theirs), share_text)
    ttfts = ratio_text(median_ttft(later_turns(ours)), median_ttft(later_turns(theirs)), ms)
    return f"- courier / courier-baseline{where}: cached share, turns 2+ {shares}; TTFT p50 ms, turns 2+ {ttfts}"


def courier_cells(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return "- | - | -"
    keys = ("snapshot_entries", "snapshot_evictions_lru", "snapshot_self_evictions")
    return " | ".join(str(stats.get(key, "?")) for key in keys)


def budget_label(run: InterleavedRun) -> str:
    if run.budget == EQUAL_BUDGET:
        return f"equal ({run.budget_bytes} B)"
    if run.budget == ANCHOR_BUDGET:
        return f"--prompt-cache-size {ANCHOR_CACHE_SIZE}"
    return run.budget


def print_baseline_lines(runs: Sequence[InterleavedRun]) -> None:
    """courier / courier-baseline for every (model, budget, K) both ran."""
    baseline = {(run.model, run.budget, run.conversations): run for run in runs if run.server.label == COURIER_BASELINE}
    pairs = [
        (run, baseline[run.model, run.budget, run.conversations])
        for run in runs
        if run.server.label == COURIER and (run.model, run.budget, run.conversations) in baseline
    ]
    for ours, theirs in pairs:
        print(baseline_line(f", {ours.model}, {budget_label(ours)}, K={ours.conversations}", ours.turns, theirs.turns))
    if pairs:
        print()


def print_part_b(runs: Sequence[InterleavedRun], budgets: Sequence[ByteBudget], held: Sequence[HeldWarm]) -> None:
    print("### (b) K interleaved conversations, tiny models\n")
    print_launches([run.server for run in runs])
    for budget in budgets:
        print(f"- equal budget for {budget.model}: {budget.capacity_bytes} B ({budget.explanation})")
    print()
    print(
        "| model | budget | K | server | cached share, turns 2+ | warm turns | TTFT p50 ms, turns 2+ "
        "| TTFT p50 ms, turn 1 | empty replies | courier entries | evictions_lru | self_evictions |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = {name: index for index, name in enumerate(B_BUDGETS)}
    for run in sorted(runs, key=lambda item: (item.model, order[item.budget], item.server.label, item.conversations)):
        share = "FAILED" if run.server.error is not None else share_text(run.cached_share)
        print(
            f"| {run.model} | {budget_label(run)} | {run.conversations} | {run.server.label} | {share} "
            f"| {share_text(run.warm_turns)} | {ms(run.ttft_p50_later_s)} | {ms(run.ttft_p50_first_s)} "
            f"| {run.empty_replies} | {courier_cells(run.courier_stats)} |"
        )
    print()
    print_baseline_lines(runs)
    if not held:
        return
    print(
        f"Conversations held warm at the equal budget: the largest swept K up to which the cached share stays >= "
        f"{WARM_FRACTION:.0%} of the server's own share with an unconstrained cache at K={REFERENCE_K}.\n"
    )
    print("| model | server | unconstrained share | threshold | conversations held warm |")
    print("|---|---|---|---|---|")
    for item in held:
        threshold = "n/a" if item.threshold is None else f"{item.threshold:.1%}"
        count = "n/a" if item.conversations is None else f"{'>= ' if item.at_least else ''}{item.conversations}"
        print(f"| {item.model} | {item.server} | {share_text(item.reference_share)} | {threshold} | {count} |")
    print()
    for model in dict.fromkeys(item.model for item in held):
        counts = {item.server: item.conversations for item in held if item.model == model}
        ours, theirs = counts.get(COURIER), counts.get(MLX_LM_F32)
        capped = any(item.at_least for item in held if item.model == model)
        if ours is not None and theirs:
            note = " (a count reached the end of the sweep: widen --equal-conversations)" if capped else ""
            print(f"- {model}: courier / mlx_lm.server = {ours} / {theirs} = {ours / theirs:.2f}x{note}")
        else:
            print(f"- {model}: courier {ours}, mlx_lm.server {theirs}: no ratio")
        if COURIER_BASELINE in counts:
            count_text = ratio_text(ours, counts[COURIER_BASELINE], lambda n: "n/a" if n is None else f"{n:.0f}")
            print(f"- {model}: courier / courier-baseline = {count_text}")
    print()


def print_part_c(store: StoreLatencyResult) -> None:
    low, high = store.suffix_tokens
    print(f"### (c) Snapshot store latency, {store.entries} entries in process\n")
    print(
        f"- vectors: a {store.prefix_tokens}-token shared prefix + {low}-{high} random tokens, "
        f"{store.sessions} sessions; built in {store.build_s:.1f} s\n"
    )
    print("| operation | count | p50 us | p99 us | max us | unexpected outcomes |")
    print("|---|---|---|---|---|---|")
    for op in store.operations:
        print(
            f"| {op.operation} | {op.count} | {op.p50_us:.1f} | {op.p99_us:.1f} | {op.max_us:.1f} | {op.unexpected} |"
        )
    lookups = [op for op in store.operations if op.operation.startswith("lookup")]
    worst = max((op.p99_us for op in lookups), default=float("nan"))
    verdict = "meets" if worst < STORE_LOOKUP_TARGET_US else "misses"
    print(f"\n- worst lookup p99 {worst:.1f} us: {verdict} the target (< {STORE_LOOKUP_TARGET_US:.0f} us)\n")


def stat_cell(stats: dict[str, Any] | None, key: str) -> str:
    if stats is None:
        return "-"
    value = stats.get(key, "?")
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def verdict_text(value: float | None, target: float, *, at_most: bool = False) -> str:
    if value is None:
        return "n/a"
    return "met" if (value <= target if at_most else value >= target) else "MISSED"


def launches_of(result: DiskTierResult) -> list[ServerLaunch]:
    launches = [run.server for run in result.runs]
    for restart in result.restarts:
        launches += [restart.before] + ([restart.after] if restart.after is not None else [])
    for item in result.ttft:
        launches += ([item.probe] if item.probe is not None else []) + [item.server]
    return launches


D1_STATS = (
    *("snapshot_memory_entries", "snapshot_disk_entries", "snapshot_disk_hits", "snapshot_spills"),
    *("snapshot_disk_restores", "snapshot_disk_read_ms_mean", "snapshot_disk_write_ms_mean"),
    "snapshot_lookups_timed_out",
)
D2_STATS = ("snapshot_disk_hits", "snapshot_disk_restores", "snapshot_lookups_timed_out")
# Signs of trouble, printed under a table when any is not 0.
D_TROUBLE = (
    *("snapshot_lookups_timed_out", "snapshot_disk_read_errors", "snapshot_disk_unreadable"),
    *("snapshot_disk_write_errors", "snapshot_disk_write_failures", "snapshot_disk_write_losses"),
    *("snapshot_disk_writes_refused", "snapshot_disk_restores_refused", "snapshot_disk_evictions_lru"),
)


def trouble_text(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return ""
    return ", ".join(f"{key} {stats[key]}" for key in D_TROUBLE if stats.get(key))


def print_part_d1(result: DiskTierResult) -> None:
    print(
        f"#### (d1) K interleaved conversations, a memory budget for {result.budget_conversations} conversations, "
        "a disk tier\n"
    )
    print(
        "| model | K | server | cached share, turns 2+ | warm turns | TTFT p50 ms, turns 2+ | TTFT p50 ms, turn 1 "
        "| empty replies | wall s | memory entries | disk entries | disk hits | spills | restores | read ms mean "
        "| write ms mean | lookups timed out |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in result.runs:
        share = "FAILED" if run.server.error is not None else share_text(run.cached_share)
        cells = " | ".join(stat_cell(run.courier_stats, key) for key in D1_STATS)
        print(
            f"| {run.model} | {run.conversations} | {run.server.label} | {share} | {share_text(run.warm_turns)} "
            f"| {ms(run.ttft_p50_later_s)} | {ms(run.ttft_p50_first_s)} | {run.empty_replies} | {run.wall_s:.0f} "
            f"| {cells} |"
        )
    print()
    for run in result.runs:
        trouble = trouble_text(run.courier_stats)
        if trouble:
            print(f"- {run.model} K={run.conversations} {run.server.label}: {trouble}")
    top = max((run.conversations for run in result.runs), default=None)
    for run in result.runs:
        if run.conversations == top and is_courier(run.server.label):
            print(
                f"- target, >= {D_TARGET_SHARE:.0%} of turns-2+ prompt tokens cached at K={top}, {run.model}: "
                f"courier {share_text(run.cached_share)}, {verdict_text(run.cached_share, D_TARGET_SHARE)}"
            )
        elif run.conversations == top:
            print(f"- {run.model}, K={top}: {run.server.label} {share_text(run.cached_share)}")
    print()


def print_part_d2(result: DiskTierResult) -> None:
    print("#### (d2) After a restart: one more turn of every conversation\n")
    print(
        "| model | K | server | stop | cached share before, turns 2+ | exit s (status) | adopted | next turn: "
        "cached share | next turns warm | TTFT p50 ms, next turn | disk hits | restores | lookups timed out |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in result.restarts:
        failed = run.before.error is not None or run.after is None or run.after.error is not None
        after = "FAILED" if failed else share_text(run.cached_share_after)
        stop_s = "n/a" if run.before.stop_s is None else f"{run.before.stop_s:.2f} ({run.before.exit_code})"
        cells = " | ".join(stat_cell(run.stats_after, key) for key in D2_STATS)
        print(
            f"| {run.model} | {run.conversations} | {run.label} | {run.stop} | {share_text(run.cached_share_before)} "
            f"| {stop_s} | {stat_cell(run.stats_at_start, 'snapshot_disk_adopted')} | {after} "
            f"| {share_text(run.warm_after)} | {ms(run.ttft_p50_after_s)} | {cells} |"
        )
    print()
    for run in result.restarts:
        if run.stats_at_stop is not None:
            stop = run.stats_at_stop
            idle = "" if run.idle_wait_s is None else f" (idle after {run.idle_wait_s:.1f} s)"
            print(
                f"- {run.model} {run.stop}{idle}: at the signal {stop.get('snapshot_memory_entries')} entries in "
                f"memory, {stop.get('snapshot_disk_entries')} on disk, warm-ups pending "
                f"{stop.get('snapshot_warmups_pending')}, disk work pending {stop.get('snapshot_disk_pending')}"
            )
        trouble = trouble_text(run.stats_after)
        if trouble:
            print(f"- {run.model} {run.label} {run.stop}, after the restart: {trouble}")
    for run in result.restarts:
        if is_courier(run.label):
            print(
                f"- target, >= {D_TARGET_SHARE:.0%} of the next turns' prompt tokens cached after a restart, "
                f"{run.model}, {run.stop}: courier {share_text(run.cached_share_after)}, "
                f"{verdict_text(run.cached_share_after, D_TARGET_SHARE)}"
            )
    print()


def verified_ttfts(item: DiskTtft, kind: str) -> list[float]:
    return [sample.ttft_s for sample in item.samples if sample.kind == kind and sample.verified]


def print_part_d3(result: DiskTierResult) -> None:
    tokens = next((sample.prompt_tokens for item in result.ttft for sample in item.samples), None)
    print(f"#### (d3) TTFT of a {tokens}-token prompt on SmolLM2: cold, from disk, from memory\n")
    for item in result.ttft:
        if item.capacity_bytes is not None and item.entry_bytes is not None:
            print(
                f"- {item.server.label}: memory budget {item.capacity_bytes} B ({D3_CAPACITY_ENTRIES} snapshots of "
                f"{item.entry_bytes} B, the conversation's at rest as a memory-only Courier weighed it)"
            )
        elif item.capacity_bytes is not None:
            print(f"- {item.server.label}: memory budget {item.capacity_bytes} B (--d-ttft-capacity-bytes)")
    print()
    print(
        "| server | measure | verified | TTFT p50 ms | min ms | max ms | prompt tokens | cached tokens, median "
        "| disk hits gained | memory hits gained | lookups timed out |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for item in result.ttft:
        for kind in D3_KINDS:
            samples = [sample for sample in item.samples if sample.kind == kind]
            if not samples:
                continue
            ttfts = verified_ttfts(item, kind)
            cached = [sample.cached_tokens or 0 for sample in samples]
            hits = [sample.disk_hits for sample in samples if sample.disk_hits is not None]
            memory_hits = [sample.memory_hits for sample in samples if sample.memory_hits is not None]
            timed_out = [sample.lookups_timed_out for sample in samples if sample.lookups_timed_out is not None]
            low = ms(min(ttfts)) if ttfts else "n/a"
            high = ms(max(ttfts)) if ttfts else "n/a"
            print(
                f"| {item.server.label} | {kind} | {len(ttfts)}/{len(samples)} | {ms(median_of(ttfts))} | {low} "
                f"| {high} | {samples[0].prompt_tokens} | {statistics.median(cached):.0f} "
                f"| {sum(hits) if hits else '-'} | {sum(memory_hits) if memory_hits else '-'} "
                f"| {sum(timed_out) if timed_out else '-'} |"
            )
    print()
    for item in result.ttft:
        if item.server.error is not None:
            print(f"- {item.server.label} FAILED: {item.server.error.splitlines()[0]}")
        cold = median_of(verified_ttfts(item, COLD))
        if is_courier(item.server.label):
            disk = median_of(verified_ttfts(item, DISK_HIT))
            memory = median_of(verified_ttfts(item, MEMORY_HIT))
            ratio = None if disk is None or not cold else disk / cold
            print(
                f"- target, TTFT p50 of a disk hit <= {D_TARGET_TTFT_RATIO}x a cold prefill: {ms(disk)} / "
                f"{ms(cold)} ms = {'n/a' if ratio is None else f'{ratio:.3f}x'}, "
                f"{verdict_text(ratio, D_TARGET_TTFT_RATIO, at_most=True)}"
            )
            if memory is not None and cold:
                print(f"- memory hit / cold: {ms(memory)} / {ms(cold)} ms = {memory / cold:.3f}x")
            trouble = trouble_text(item.courier_stats)
            if trouble:
                print(f"- courier: {trouble}")
        else:
            print(f"- {item.server.label}: cold TTFT p50 {ms(cold)} ms (no disk tier)")
    print()


def median_of(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def print_part_d(result: DiskTierResult) -> None:
    print("### (d) The disk tier\n")
    print_launches(launches_of(result))
    for budget in result.budgets:
        print(f"- memory budget for {budget.model}: {budget.capacity_bytes} B ({budget.explanation})")
    print("- wall time: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.wall_s.items()) + "\n")
    if result.runs:
        print_part_d1(result)
    if result.restarts:
        print_part_d2(result)
    if result.ttft:
        print_part_d3(result)


def write_json(report: Report, path: Path) -> None:
    path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")


# ---------------------------------------------------------------- main


def choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in allowed]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(names))

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--parts", type=choices(PARTS), default=list(DEFAULT_PARTS), help="parts to run (a,b,c; d when asked for)")
    add("--conversations", type=positive_ints, default=[2, 8, 32], help="part b: K values (2,8,32)")
    add("--turns", type=int, default=10, help="part a: turns of the conversation (10)")
    add("--a-max-tokens", type=int, default=24, help="part a: max_tokens per turn (24)")
    add(
        "--a-servers",
        type=server_list,
        default=None,
        help=f"part a servers ({','.join(A_SERVERS)}, plus {COURIER_BASELINE} with --baseline-tree)",
    )
    add("--b-turns", type=int, default=4, help="part b: turns per conversation (4)")
    add(
        "--b-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS_B,
        help=f"part b: max_tokens per turn ({DEFAULT_MAX_TOKENS_B})",
    )
    add("--b-models", type=choices(TINY_MODELS), default=list(TINY_MODELS), help="part b models (llama,qwen3_next)")
    add(
        "--b-servers",
        type=choices(B_SERVERS),
        default=None,
        help=f"part b servers ({','.join(B_SERVERS)}; {COURIER_BASELINE} only with --baseline-tree)",
    )
    add(
        "--b-system-tokens",
        type=int,
        default=DEFAULT_SYSTEM_TOKENS_B,
        help=f"part b: tokens of each conversation's system prompt ({DEFAULT_SYSTEM_TOKENS_B}, calibrated)",
    )
    add("--b-budgets", type=choices(B_BUDGETS), default=list(B_BUDGETS), help=f"part b budgets ({','.join(B_BUDGETS)})")
    add(
        "--equal-conversations",
        type=positive_ints,
        default=EQUAL_CONVERSATIONS,
        help=f"part b: K values at the equal budget ({','.join(map(str, EQUAL_CONVERSATIONS))})",
    )
    add(
        "--budget-states",
        type=int,
        default=BUDGET_STATES,
        help=f"part b: equal budget in model states ({BUDGET_STATES})",
    )
    add("--budget-bytes", type=int, default=None, help="part b: the equal byte budget itself (default: derived)")
    add(
        "--courier-arg",
        action="append",
        default=[],
        help="extra flag for every Courier server, as --courier-arg=--flag=value (repeatable)",
    )
    add("--store-entries", type=int, default=10_000, help="part c: entries in the store (10000)")
    add("--store-sessions", type=int, default=1000, help="part c: sessions the entries belong to (1000)")
    add("--store-lookups", type=int, default=2000, help="part c: lookups timed per kind (2000)")
    add("--seed", type=int, default=0, help="part c: random seed (0)")
    add("--d-sections", type=choices(D_SECTIONS), default=list(D_SECTIONS), help="part d sections (1,2,3)")
    add("--d-models", type=choices(TINY_MODELS), default=list(TINY_MODELS), help="part d models (llama,qwen3_next)")
    add("--d-servers", type=choices(D_SERVERS), default=list(D_SERVERS), help="part d servers (courier,mlx-lm-f32)")
    add(
        "--d-conversations",
        type=positive_ints,
        default=D_CONVERSATIONS,
        help=f"part d1: K values ({','.join(map(str, D_CONVERSATIONS))})",
    )
    add("--d-turns", type=int, default=D_TURNS, help=f"part d1, d2: turns per conversation ({D_TURNS})")
    add(
        "--d-budget-conversations",
        type=int,
        default=D_BUDGET_CONVERSATIONS,
        help=f"part d1, d2: memory budget in model states of a conversation ({D_BUDGET_CONVERSATIONS})",
    )
    add("--d-budget-bytes", type=int, default=None, help="part d1, d2: the memory budget itself (default: derived)")
    add(
        "--d-disk-bytes",
        type=int,
        default=D_DISK_BYTES,
        help=f"part d: Courier's --prompt-cache-disk-bytes ({D_DISK_BYTES})",
    )
    add(
        "--d-restart-conversations",
        type=int,
        default=D_RESTART_CONVERSATIONS,
        help=f"part d2: K ({D_RESTART_CONVERSATIONS})",
    )
    add(
        "--d-restart-signals",
        type=choices(tuple(D_STOP_SIGNALS)),
        default=list(D_STOP_SIGNALS),
        help="part d2: how Courier is stopped (term,kill; mlx_lm.server: the first only)",
    )
    add("--d-ttft-repeats", type=int, default=D_TTFT_REPEATS, help=f"part d3: repeats ({D_TTFT_REPEATS})")
    add(
        "--d-history-tokens",
        type=int,
        default=D_HISTORY_TOKENS,
        help=f"part d3: prompt tokens of the conversation ({D_HISTORY_TOKENS})",
    )
    add(
        "--d-ttft-max-tokens",
        type=int,
        default=D_TTFT_MAX_TOKENS,
        help=f"part d3: max_tokens per request ({D_TTFT_MAX_TOKENS})",
    )
    add(
        "--d-ttft-capacity-bytes",
        type=int,
        default=None,
        help="part d3: Courier's memory budget (default: 2.5 snapshots of the conversation at rest, measured)",
    )
    add("--run-timeout", type=float, default=900.0, help="seconds of measuring one server run may take (900)")
    add("--cache-dir", type=Path, default=None, help="model cache (default: a temporary directory)")
    add("--json", type=Path, default=None, help="also write the raw results here")
    add("--openblas", default=OPENBLAS_PATH, help=f"LD_PRELOAD for mlx_lm.server on float32 ({OPENBLAS_PATH})")
    add_baseline_argument(parser)
    args = parser.parse_args(argv)
    args.a_servers = choose_servers(parser, "--a-servers", args.a_servers, A_SERVERS, args.baseline_tree)
    default_b = [label for label in B_SERVERS if label != COURIER_BASELINE]
    args.b_servers = choose_servers(parser, "--b-servers", args.b_servers, default_b, args.baseline_tree)
    args.d_restart_signals = [D_STOP_SIGNALS[name] for name in args.d_restart_signals]
    return args


def settings_of(args: argparse.Namespace) -> dict[str, object]:
    keys = (
        *("parts", "conversations", "turns", "a_max_tokens", "a_servers", "b_turns", "b_max_tokens", "b_models"),
        *("b_servers", "b_system_tokens", "b_budgets", "equal_conversations", "budget_states", "budget_bytes"),
        *("courier_arg", "store_entries", "store_lookups"),
        *("d_sections", "d_models", "d_servers", "d_conversations", "d_turns", "d_budget_conversations"),
        *("d_budget_bytes", "d_disk_bytes", "d_restart_conversations", "d_ttft_repeats", "d_history_tokens"),
        *("d_ttft_max_tokens", "d_ttft_capacity_bytes"),
    )
    settings = {key: getattr(args, key) for key in keys}
    settings["d_restart_signals"] = [stop.name for stop in args.d_restart_signals]
    return settings | {"baseline_tree": str(args.baseline_tree) if args.baseline_tree else None}


def servers_run(args: argparse.Namespace) -> list[str]:
    """Every server parts a, b and d will start."""
    return [
        *(args.a_servers if "a" in args.parts else []),
        *(args.b_servers if "b" in args.parts else []),
        *(args.d_servers if "d" in args.parts else []),
    ]


def needs_openblas(args: argparse.Namespace) -> bool:
    return MLX_LM_F32 in servers_run(args)


def run_servers(
    args: argparse.Namespace,
) -> tuple[list[ConversationRun], tuple[list[InterleavedRun], list[ByteBudget], list[HeldWarm]], DiskTierResult | None]:
    """Parts a, b and d, which share the 4-bit SmolLM2 directory (the tiny models borrow its tokenizer)."""
    if not {"a", "b", "d"} & set(args.parts):
        return [], ([], [], []), None
    with cache_directory(args.cache_dir) as cache_dir:
        progress("converting the embedded GGUF to a 4-bit MLX directory")
        dir4 = prepare_4bit_dir(cache_dir)
        conversation = run_part_a(cache_dir, dir4, args) if "a" in args.parts else []
        interleaved = run_part_b(cache_dir, dir4, args) if "b" in args.parts else ([], [], [])
        disk_tier = run_part_d(cache_dir, dir4, args) if "d" in args.parts else None
    return conversation, interleaved, disk_tier


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if needs_openblas(args) and not Path(args.openblas).is_file():
        progress(f"OpenBLAS not found at {args.openblas}; pass --openblas PATH or leave out {MLX_LM_F32}")
        return 2
    if not baseline_ready(args.baseline_tree, servers_run(args)):
        return 2
    blas = load_optimized_blas()  # before MLX is imported, as bench.throughput does
    conversation, (interleaved, budgets, held), disk_tier = run_servers(args)
    report = Report(
        environment=environment(blas),
        settings=settings_of(args),
        conversation=conversation,
        interleaved=interleaved,
        budgets=budgets,
        held_warm=held,
        store=measure_store(args) if "c" in args.parts else None,
        disk_tier=disk_tier,
    )
    print_report(report)
    if args.json is not None:
        write_json(report, args.json)
        progress(f"raw results written to {args.json}")
    failed = [run.server for run in report.conversation] + [run.server for run in report.interleaved]
    failed += launches_of(disk_tier) if disk_tier is not None else []
    return 1 if any(launch.error for launch in failed) else 0


if __name__ == "__main__":
    sys.exit(main())

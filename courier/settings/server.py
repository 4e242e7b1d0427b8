"""`Settings`: every setting of the server, each declared once with its default, parser and help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import platformdirs

from courier.settings.option import setting
from courier.settings.parsers import (
    LOG_LEVELS,
    WEIGHT_FORMATS,
    choice,
    expanded_path,
    int_between,
    optional_number,
    optional_path,
    optional_text,
    parse_api_prefix,
    parse_bool,
    parse_bytes,
    parse_embedding_pooling,
    parse_kv_bits,
    parse_model_specs,
    parse_names,
    parse_non_negative_float,
    parse_non_negative_int,
    parse_port,
    parse_positive_bytes,
    parse_positive_float,
    parse_positive_int,
    parse_prompt_cache_bits,
    parse_prompt_cache_group_size,
    parse_replica_id,
    parse_storage_url,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    host: str = setting("127.0.0.1", str, "interface to listen on", metavar="HOST")
    port: int = setting(8000, parse_port, "TCP port; 0 picks a free one", metavar="PORT")
    api_prefix: str = setting(
        "",
        parse_api_prefix,
        "serve every route under this path (e.g. /courier -> /courier/v1/chat/completions)",
        metavar="PATH",
    )
    model: tuple[str, ...] = setting(
        (),
        parse_model_specs,
        "MLX model directory, .gguf file or Hugging Face repo id, optionally named (NAME[,ALIAS...]=MODEL); repeat "
        "the flag to serve several, the first being the default (none and no --models-dir: embedded "
        "SmolLM2-135M-Instruct)",
        metavar="[NAME=]MODEL",
        repeated=True,
    )
    served_model_name: str | None = setting(
        None,
        optional_text,
        "model id clients use (default: derived from --model); several comma-separated: the first is the id, the "
        "others aliases a request may name instead (one ending in * matches any name it begins, e.g. claude-*)",
        metavar="NAME[,ALIAS...]",
    )
    models_dir: Path | None = setting(  # noqa: RUF009
        None,
        optional_path,
        "also serve every MLX model directory and .gguf file under this directory, each named by its path below it "
        "(mlx-community/Qwen3-0.6B-4bit, tiny.Q4_0), loaded when a request names it",
        metavar="DIR",
    )
    models_memory_bytes: int | None = setting(
        None,
        parse_positive_bytes,
        "memory the loaded models may take together (weights, live KV allowance, prompt-cache memory tier); a "
        "model that does not fit unloads the least recently used idle ones (default: three quarters of the memory "
        "available at start-up)",
        metavar="BYTES",
    )
    max_loaded_models: int = setting(
        0, parse_non_negative_int, "most models loaded at once (0: as many as the memory budget holds)", metavar="N"
    )
    model_ttl: float = setting(
        0.0,
        parse_non_negative_float,
        "seconds a model stays loaded after its last request ends (0: until its memory is needed); a request's "
        "keep_alive overrides it",
        metavar="SECONDS",
    )
    pin: tuple[str, ...] = setting(
        (),
        parse_names,
        "models never unloaded, by name (repeat the flag or separate by commas); loaded at start-up",
        metavar="NAME",
        repeated=True,
    )
    embedding_pooling: tuple[str, ...] = setting(
        (),
        parse_embedding_pooling,
        "let a generative model answer /v1/embeddings, its hidden states pooled by their mean or its last token "
        "(NAME=POOLING; no NAME: the default model; repeat the flag or separate by commas)",
        metavar="[NAME=]mean|last",
        repeated=True,
    )
    cache_dir: Path = setting(  # noqa: RUF009
        Path(platformdirs.user_cache_dir("courier")), expanded_path, "where converted models are kept", metavar="DIR"
    )
    weight_format: str = setting(
        "auto",
        choice(WEIGHT_FORMATS),
        "serving weights: auto (float32 on CPU, as stored on GPU), native, float32, float16, bfloat16",
        metavar="FORMAT",
    )
    blas: str = setting("auto", str, "CPU BLAS for MLX: auto (find OpenBLAS), none, or a library path", metavar="BLAS")
    blas_gemv: bool = setting(
        True,
        parse_bool,
        "send MLX's CPU matmuls of 1-3 rows (decode steps) to OpenBLAS's gemv, through a shim built with a C compiler",
        flag=True,
    )
    cpu_attention: bool = setting(
        True,
        parse_bool,
        "compute float32 attention on the CPU with a compiled polynomial exp (prefill ~1.4x at 1.5k tokens)",
        flag=True,
    )
    warmup: bool = setting(True, parse_bool, "run one short forward pass before reporting ready", flag=True)
    trust_remote_code: bool = setting(
        False,
        parse_bool,
        "allow a model directory's own architecture file (config.json `model_file`) to be imported and run",
        flag=True,
    )
    max_body_bytes: int = setting(
        32 * 1024**2,
        parse_bytes,
        "largest request body accepted (413 beyond); accepts 64MiB, 1GB, ...",
        metavar="BYTES",
    )
    body_timeout: float = setting(
        60.0,
        parse_positive_float,
        "seconds a client gets to send a whole request body (408 beyond), however slowly it trickles",
        metavar="SECONDS",
    )
    keep_alive_timeout: float = setting(
        30.0,
        parse_positive_float,
        "seconds an idle connection is kept for its client's next request (and a connection has to send a "
        "request's head); longer than the 5 s for which httpx (the openai and anthropic SDKs) pools one, so those "
        "clients never send on a connection the server is closing",
        metavar="SECONDS",
    )
    max_connections: int = setting(
        1024,
        parse_positive_int,
        "most open client connections; beyond them a new connection is answered 503 and closed (kept below the "
        "open-file limit)",
        metavar="N",
    )
    max_batch: int = setting(16, parse_positive_int, "sequences generated together in one batch", metavar="N")
    speculation: bool = setting(
        True,
        parse_bool,
        "multi-token decode steps: drafts looked up in each sequence's own prompt and output, verified in one "
        "batched forward pass (lossless), and tokens a grammar forces (dense KV-cache models only)",
        flag=True,
    )
    speculative_ngram: int = setting(
        4,
        lambda text: int_between(text, 2, 16),
        "longest run of a sequence's last tokens matched against its context for a draft (2-16; shorter runs "
        "down to 2 are tried next)",
        metavar="N",
    )
    speculative_tokens: int = setting(
        8,
        lambda text: int_between(text, 1, 64),
        "draft tokens proposed per sequence (1-64); how many are verified in a step follows the measured cost of "
        "a wider pass and each sequence's acceptance",
        metavar="K",
    )
    max_queue: int = setting(
        64,
        parse_non_negative_int,
        "requests waiting for a batch slot; beyond it requests get 429 with Retry-After",
        metavar="N",
    )
    max_n: int = setting(
        8,
        parse_positive_int,
        "most samples ('n') one chat or completions request may ask for; each takes a batch slot, so the batch "
        "size caps it too",
        metavar="N",
    )
    prefill_step_size: int = setting(
        512,
        parse_positive_int,
        "prompt tokens prefilled per step; smaller keeps running streams flowing during long prefills",
        metavar="TOKENS",
    )
    prefill_stall_ms: float = setting(
        500.0,
        parse_non_negative_float,
        "how long a step's prefill of new prompts may take: the extra wait of running streams for their next "
        "token, and about the longest a new request waits to join beside a long prompt; each prompt's chunk is "
        "sized to fit, from the measured cost of a token at the depth the prompt has reached (0: a whole "
        "--prefill-step-size chunk)",
        metavar="MS",
    )
    mlx_cache_limit: int = setting(
        1024**3,
        parse_bytes,
        "most bytes of freed buffers MLX keeps for reuse (0 keeps none); bounds memory under varied traffic",
        metavar="BYTES",
    )
    malloc_tuning: bool = setting(
        True,
        parse_bool,
        "pin glibc's mmap and trim thresholds at 128 KiB so freed memory goes back to the system",
        flag=True,
    )
    admission_window_ms: float = setting(
        20.0,
        parse_non_negative_float,
        "an idle scheduler waits for more arrivals so a burst is prefilled as one batch: while they keep "
        "coming at most this far apart, up to 5 times this in all; a lone request goes in at once when the step "
        "admitting it is estimated at no more than this (so with --prefill-stall-ms below it, always); 0 disables",
        metavar="MS",
    )
    request_timeout: float = setting(
        600.0,
        parse_positive_float,
        "deadline in seconds for one generation request, queueing included: a reply still running then ends as a "
        "length cut with what it wrote; one not started is a 504",
        metavar="SECONDS",
    )
    stream_keepalive: float = setting(
        5.0,
        parse_positive_float,
        "seconds a stream may stay silent (queued, or prefilling a long prompt) before a keep-alive is sent "
        "(an SSE comment on the OpenAI APIs, Anthropic's ping event), so clients and proxies do not give up on it",
        metavar="SECONDS",
    )
    default_max_tokens: int = setting(
        4096,
        parse_non_negative_int,
        "output tokens a reply may have when its request sets no limit, or fewer if the context leaves fewer "
        "(0: whatever the context leaves)",
        metavar="TOKENS",
    )
    grammar_cache: int = setting(
        256,
        parse_positive_int,
        "compiled grammars (JSON schemas, tool calls) kept for reuse, least recently used first out",
        metavar="N",
    )
    cors_allow_origins: str | None = setting(
        None,
        optional_text,
        "origins browser UIs may call from, comma-separated (https://ui.example,http://localhost:3000), or * for "
        "any (unset: no CORS headers)",
        metavar="ORIGINS",
    )
    default_temperature: float | None = setting(
        None,
        lambda text: optional_number(text, 0.0, 2.0, "a temperature"),
        "temperature for requests that send none (unset: the model's generation_config.json, else 1.0)",
        metavar="T",
    )
    default_top_p: float | None = setting(
        None,
        lambda text: optional_number(text, 0.0, 1.0, "a top_p", open_low=True),
        "top_p for requests that send none (unset: the model's generation_config.json, else 1.0)",
        metavar="P",
    )
    max_images: int = setting(
        16,
        parse_positive_int,
        "most image parts one request may hold (more is a 400, before anything is fetched)",
        metavar="N",
    )
    max_image_bytes: int = setting(
        64 * 1024**2,
        parse_positive_bytes,
        "most bytes read for one image, enforced while it streams in (a vision model only)",
        metavar="BYTES",
    )
    max_image_pixels: int = setting(
        50_000_000,
        parse_positive_int,
        "most pixels (width x height) of one image, read from its header before decoding",
        metavar="N",
    )
    max_image_memory_bytes: int = setting(
        1024**3,
        parse_positive_bytes,
        "most bytes of decoded images held at once, across requests: a request needing more is a 400, one that "
        "would overrun what others hold waits its turn",
        metavar="BYTES",
    )
    media_path: Path | None = setting(  # noqa: RUF009
        None,
        optional_path,
        "the directory file:// image URLs are confined to (unset: file:// URLs are refused)",
        metavar="DIR",
    )
    allow_private_media_urls: bool = setting(
        False,
        parse_bool,
        "let image URLs reach loopback, private and link-local addresses (local use only: logs a warning)",
        flag=True,
    )
    prompt_cache: bool = setting(
        True,
        parse_bool,
        "keep model state snapshots so a conversation's next turn prefills only its new tokens",
        flag=True,
    )
    prompt_cache_snapshot_capacity_bytes: int | None = setting(
        None,
        parse_positive_bytes,
        "byte budget of the snapshot store (default: sized from the model's state and the device's memory)",
        metavar="BYTES",
    )
    prompt_cache_snapshot_max_entries: int = setting(4096, parse_positive_int, "most snapshots kept", metavar="N")
    prompt_cache_snapshot_ttl: float = setting(
        7200.0, parse_positive_float, "seconds a snapshot is kept after its last use", metavar="SECONDS"
    )
    prompt_cache_dir: Path | None = setting(  # noqa: RUF009
        None,
        optional_path,
        "where the prompt cache's disk tier keeps snapshot files, one private subdirectory per model (default: "
        "prompt-cache under --cache-dir)",
        metavar="DIR",
    )
    prompt_cache_disk_bytes: int | None = setting(
        None,
        parse_bytes,
        "byte budget of the prompt cache's disk tier, which keeps conversations warm through evictions and "
        "restarts; 0 turns it off (default: sized from the model's state, at most half the free disk space)",
        metavar="BYTES",
    )
    prompt_cache_bits: int | None = setting(
        None,
        parse_prompt_cache_bits,
        "store the prompt cache's attention KV quantized to 8 or 4 bits, in memory and on disk, so the same budgets "
        "hold about 2-6x the conversations (recurrent layers stay exact; see docs/prompt-cache.md for what it costs "
        "in quality); off: as the model computes it",
        metavar="BITS",
    )
    prompt_cache_group_size: int = setting(
        64,
        parse_prompt_cache_group_size,
        "values sharing one scale and bias in quantized snapshots (32, 64 or 128); it must divide the model's "
        "attention head dimension, or that model does not load",
        metavar="N",
    )
    kv_bits: int | None = setting(
        None,
        parse_kv_bits,
        "keep the running batch's attention KV quantized to 8 or 4 bits (prompts prefill at full precision, and "
        "rows are quantized as they start decoding): about 2-4x the streams in the same memory, for slower decode "
        "steps on CPU (see docs/prompt-cache.md); recurrent layers stay exact, models with attention sinks refuse "
        "it; off: as the model computes it",
        metavar="BITS",
        strict=True,
    )
    kv_group_size: int = setting(
        64,
        parse_prompt_cache_group_size,
        "values sharing one scale and bias in the quantized batch KV (32, 64 or 128); it must divide the model's "
        "attention head dimension",
        metavar="N",
        strict=True,
    )
    prompt_cache_min_prefix: int = setting(
        16,
        parse_positive_int,
        "shortest cached prefix (tokens) worth reusing; shorter matches count as misses",
        metavar="TOKENS",
    )
    prompt_cache_normalize: bool = setting(
        True,
        parse_bool,
        "leave out system-prompt lines that change between requests and mean nothing to the model (Claude Code's "
        "x-anthropic-billing-header) before rendering, so they do not bust the prompt cache",
        flag=True,
    )
    data_dir: Path = setting(  # noqa: RUF009
        Path(platformdirs.user_data_dir("courier")),
        expanded_path,
        "where stored responses and conversations live (an SQLite database), unless --storage names PostgreSQL",
        metavar="DIR",
    )
    storage: str | None = setting(
        None,
        parse_storage_url,
        "store responses and conversations in PostgreSQL, shared by every replica given the same URL "
        "(postgresql://user:password@host:port/dbname); unset: SQLite under --data-dir",
        metavar="URL",
        strict=True,
    )
    storage_max_bytes: int = setting(
        1024**3,
        parse_positive_bytes,
        "byte budget of stored responses and conversations; the least recently updated go first",
        metavar="BYTES",
    )
    storage_max_entries: int = setting(
        100_000, parse_positive_int, "most stored responses plus conversations", metavar="N"
    )
    storage_tenant_max_bytes: int | None = setting(
        None,
        parse_positive_bytes,
        "byte budget of each API key's stored responses and conversations; a write evicts only its own key's least "
        "recently updated records, never another key's (default: --storage-max-bytes shared evenly by the keys)",
        metavar="BYTES",
    )
    storage_tenant_max_entries: int | None = setting(
        None,
        parse_positive_int,
        "most stored responses plus conversations of each API key (default: --storage-max-entries shared evenly "
        "by the keys)",
        metavar="N",
    )
    storage_ttl: float = setting(
        30 * 24 * 3600.0,
        parse_positive_float,
        "seconds a stored response or conversation is kept after its last update",
        metavar="SECONDS",
    )
    replica_id: str | None = setting(
        None,
        parse_replica_id,
        "this replica's name behind a front (1-16 of a-z, 0-9, -): every response id then carries it "
        "(resp_ID.<hex>), so a front routes the next turn, GET, DELETE and cancel of a response to this replica",
        metavar="ID",
        strict=True,
    )
    api_key: str | None = setting(
        None,
        optional_text,
        "keys clients must send as `Authorization: Bearer KEY` on every route but /health, comma-separated (unset: "
        "no key is asked for)",
        metavar="KEYS",
    )
    api_key_file: Path | None = setting(  # noqa: RUF009
        None,
        expanded_path,
        "a file of client keys, one per line (blank lines and # comments ignored), added to --api-key",
        metavar="PATH",
    )
    admin_api_key: str | None = setting(
        None,
        optional_text,
        "keys that may also do what only an operator may (POST /v1/cache/reset), comma-separated",
        metavar="KEYS",
    )
    public_metrics: bool = setting(
        False,
        parse_bool,
        "answer GET /metrics without a key even when keys are set (a scraper on a trusted network)",
        flag=True,
    )
    compaction_key_file: Path | None = setting(  # noqa: RUF009
        None,
        expanded_path,
        "a file holding a secret key: compaction capsules are then authenticated (HMAC) and foreign or altered "
        "ones refused",
        metavar="PATH",
    )
    shutdown_timeout: float = setting(
        30.0,
        parse_positive_float,
        "seconds in-flight requests get to finish after SIGTERM/SIGINT",
        metavar="SECONDS",
    )
    trace_file: Path | None = setting(  # noqa: RUF009
        None, expanded_path, "also write finished OpenTelemetry spans to this file as JSON lines", metavar="PATH"
    )
    log_level: str = setting("info", choice(LOG_LEVELS), "debug, info, warning or error", metavar="LEVEL")
    access_log: bool = setting(
        True,
        parse_bool,
        "log one line per HTTP request (logger courier.access; /health and /metrics at debug level)",
        flag=True,
    )

"""Server settings: every option is a CLI flag and a `COURIER_*` environment variable.

The package: `server.py` (`Settings`), `option.py` (`setting`, `Option`), `parsers.py` (each value's parser),
`loading.py` (`OPTIONS`, `add_arguments`, `resolve`). This module hands on what the rest of Courier uses.

A setting is declared once, as a field of `Settings` made with `setting(default, parse, help, ...)`: its name,
type and default are the field's, and its parser, help text, metavar and on/off-flag-ness ride in the field's
metadata. `OPTIONS` is derived from those fields, in declaration order, which is the order of `--help` and the docs.

Precedence is CLI flag > environment variable > default. An environment value that
does not parse logs a warning naming the variable and keeps the default, so a typo
in a deployment's environment never stops the server from starting; except for a
`strict` setting, where the default would be a different thing rather than a safe
one (`COURIER_STORAGE`: replicas meant to share PostgreSQL must not each fall back to
a SQLite file of their own; `COURIER_REPLICA_ID`: a replica behind a front must not
quietly mint ids that route nowhere), so its typo is a start-up error (`SettingsError`).
"""

from courier.settings.loading import OPTIONS, SettingsError, add_arguments, resolve
from courier.settings.server import Settings

__all__ = ["OPTIONS", "Settings", "SettingsError", "add_arguments", "resolve"]

"""What identifies a model's weights on disk, for key namespaces: blocks computed with other weights under
the same model path must never be served.
"""

from __future__ import annotations

import hashlib
import json
import os


def weights_fingerprint(model: str) -> str | None:
    """For a model that is a local folder, a digest of the name, size and mtime_ns of every file in
    it and in its direct subfolders (config, tokenizer and weight files; hidden entries skipped):
    new weights copied under the same path change it, so blocks computed with the old ones are never
    served. None for a Hub model id, whose revision names its weights instead."""
    if not os.path.isdir(model):
        return None
    files = []
    for path in _model_files(model):
        try:
            st = os.stat(path)  # follows links: a Hub snapshot folder links to the real blobs
        except FileNotFoundError:
            continue
        files.append((os.path.relpath(path, model), st.st_size, st.st_mtime_ns))
    return hashlib.blake2b(json.dumps(files).encode(), digest_size=16).hexdigest()


def _model_files(folder: str) -> list[str]:
    """Paths of the regular files of a model folder and of its direct subfolders, sorted. Only one
    level down: some checkpoints keep weights in a subfolder, none deeper."""
    out = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            out += [
                sub.path
                for sub in sorted(os.scandir(entry.path), key=lambda e: e.name)
                if sub.is_file() and not sub.name.startswith(".")
            ]
        elif entry.is_file():
            out.append(entry.path)
    return out

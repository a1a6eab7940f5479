"""MkDocs hooks for plait's docs (mkdocs.yml: ``hooks:``).

- The figures under ``benchmarks/results/`` join the site as ``results/...``, so that
  ``docs/benchmarks.md`` (which includes ``benchmarks/README.md``) shows them with the
  same relative links as the README does on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    bench = Path(config["config_file_path"]).parent / "benchmarks"
    for figure in sorted((bench / "results").glob("*.png")):
        files.append(
            File(
                f"results/{figure.name}",
                src_dir=str(bench),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files

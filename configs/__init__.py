"""The shipped pipeline configs: every `NAME.yaml` here is `mlm-pipeline run NAME`.

Installed as the package data `mlm_pipeline.configs` (`pyproject.toml`, `package-dir`), so
`load_config("NAME")` finds them from any directory; this file only makes the folder an
importable package for `importlib.resources`.
"""

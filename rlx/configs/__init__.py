"""The shipped configs, importable from a config file anywhere: ``from rlx.configs import base``.

Each module's ``get_config()`` returns an ``rlx.config.RunConfig``; run one with
``python -m rlx.main --config configs/NAME.py`` from a checkout (``configs/`` links here).
"""

"""A Tinker-compatible training service: the unmodified ``tinker`` SDK drives rlx's learner
and engine. Each training client is a LoRA adapter with its own Adam state on a shared base;
researchers write the loop (sample, score, ``forward_backward``, ``optim_step``) in plain
Python against it.

    python -m rlx.tinker --model HuggingFaceTB/SmolLM2-135M-Instruct=models/SmolLM2-135M-Instruct

``wire.py`` reads and writes the SDK's protobuf bodies, ``losses.py`` holds the API's loss
functions, ``training.py`` the adapters and their steps, ``server.py`` the HTTP service and
its futures.
"""

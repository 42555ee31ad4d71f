"""The bottom floor every other room stands on: :mod:`~stalerl.core.errors` (the user-error type and exit code),
:mod:`~stalerl.core.io` (atomic writes, JSON lines), :mod:`~stalerl.core.model` (the policy model, tokenizer and
dtype handling: the embedded tiny Qwen2 or a local HF directory), :mod:`~stalerl.core.reward` (the GSM8K answer
reward) and :mod:`~stalerl.core.launch_env` (environment variables shared by the command line and the trainers).
Modules here import no other ``stalerl`` module, so anything may import them.
"""

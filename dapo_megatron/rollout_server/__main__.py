"""``python -m dapo_megatron.rollout_server``: :func:`dapo_megatron.rollout_server.app.main`.

Design: docs/design.md §2.2 (server mode on CPU).
"""

from dapo_megatron.rollout_server.app import main

if __name__ == "__main__":
    main()

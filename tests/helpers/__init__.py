"""What several test folders share (importable as ``helpers.*``: pytest puts tests/ on the path).

- ``stack_helpers``: small real stacks and blocks whose bytes are a function of their key;
- ``disk_helpers``: host-over-disk stacks on a temporary directory, and storing and loading through them;
- ``config_helpers``: the one error a config raises;
- ``ports``: loopback ports for the servers tests start, a block per pytest process;
- ``stores``: every shared store (Redis, Mooncake) as a ``StoreUnderTest``, for the suites run over each;
- ``replay_helpers``: hand-made traces and their figures;
- ``vllm_helpers``: prompts and steps for the vLLM connector tests (no vLLM needed to import);
- ``vllm_harness``: the test engine around vLLM's own scheduler (imports vLLM).
"""

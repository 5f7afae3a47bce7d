"""The worker jobs behind ``kvstore prefill/decode/generate/demo/bench``: their torch-free
parser, the commands, the Ray deployment of their replicas, prompts and prompt keys."""

"""Decode-speed benchmark: ``python benchmarks/bench_decode.py CONFIG [taps bench options]``.

Same as ``taps bench``: vanilla vs HF generate vs HF prompt lookup vs speculative decoding on the
same prompts in one run; JSON + markdown written to ``--out``.
"""

import sys

from taps_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

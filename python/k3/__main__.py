"""python -m k3 ...: runs the k3 command-line tool installed with the package (same sub-commands),
plus ``python -m k3 plot bench.json -o bench.png`` (matplotlib) and ``python -m k3 hf generate|bench``
(a transformers Kimi-Linear model on k3 against stock; needs torch and transformers), and
``python -m k3 generate --checkpoint DIR --prompt TEXT`` (the native runner on text, tokenized with
the checkpoint's tokenizer through transformers; with --prompt-ids it is ``k3 generate``)."""

import os
import subprocess
import sys


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        from .plot import main as plot_main
        sys.exit(plot_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "hf":
        from .hf_cli import main as hf_main
        sys.exit(hf_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "generate" and any(a == "--prompt" or a.startswith("--prompt=")
                                                               for a in sys.argv[2:]):
        from .generate_cli import main as generate_main
        sys.exit(generate_main(sys.argv[2:]))
    tool = os.path.join(os.path.dirname(__file__), "bin", "k3")
    if not os.path.exists(tool):
        sys.exit("python -m k3: the k3 tool was not installed with this package (" + tool + ")")
    sys.exit(subprocess.call([tool] + sys.argv[1:]))


if __name__ == "__main__":
    main()

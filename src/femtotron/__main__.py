"""`python -m femtotron ...`, as the `femtotron` command; torchrun and the local launcher start this."""

import sys

from femtotron.cli import main

if __name__ == "__main__":
    sys.exit(main())

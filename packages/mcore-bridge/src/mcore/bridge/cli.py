"""Entry point of the ``mcore-bridge`` console script."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("mcore-bridge: this command is not built yet (see the project's open issues).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

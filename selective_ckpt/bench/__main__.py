import os

os.environ.setdefault("PYTHONUNBUFFERED", "1")

from . import main  # noqa: E402

main()

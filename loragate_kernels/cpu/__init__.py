"""The CPU's C++ ops: their sources, their builder (`build.py`) and their Python entry points (`ops.py`)."""

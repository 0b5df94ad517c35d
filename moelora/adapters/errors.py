"""Adapter errors: each names the adapter and, where one is at fault, the tensor."""


class AdapterError(ValueError):
    def __init__(self, adapter: str, message: str, tensor: str | None = None) -> None:
        self.adapter, self.tensor = adapter, tensor
        where = f"adapter {adapter!r}" + (f": tensor {tensor!r}" if tensor else "")
        super().__init__(f"{where}: {message}")

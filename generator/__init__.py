"""epgen generator: specs/ (TOML) -> variants -> rendered GPU sources -> compiled, ISA-verified code objects."""

__version__ = "0.1.0"

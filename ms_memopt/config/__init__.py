"""One schema for what a user writes: recipes (``recipe``) and MindFormers configs (``mfconfig``).

Every key has one dataclass field with one default; the readers map YAML onto them and name the
key path of a bad value. The engine and the MindSpore adapter read these objects, never YAML.
"""

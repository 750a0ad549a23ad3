"""Small utilities every layer may use: module-name patterns, the private torch APIs par3d uses (each behind one
function), every change par3d makes to a user's model objects (``model_changes``), one call in a fresh interpreter,
and the console rules of par3d's own programs."""

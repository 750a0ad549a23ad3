"""The bundled example: a small GPT over a slice of Shakespeare, trained with par3d."""

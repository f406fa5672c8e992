from tests.determinism import initialise_vector_math

# Note [First VML call race]: before anything a test compares is computed.
initialise_vector_math()

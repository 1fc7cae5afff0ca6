"""One ``APIRouter`` per route group, each built from the app's ``Services`` (``router(services)``)."""

"""The stages as plain typed functions, and the engine runtimes. No prefect, mlflow or fastapi here."""

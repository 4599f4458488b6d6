"""AutoPolicy: the only package that runs trial steps to choose a run's plan. It sits above
``runtime/`` (its trials run the trainer) and below the CLI; ``plan/`` holds the data and pure
functions it chooses among."""

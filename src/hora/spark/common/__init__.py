"""What hora's Spark Estimators share: the store (:mod:`.store`), the DataFrame checks and the
Parquet writing and reading (:mod:`.data`), the parameters and the fit itself."""

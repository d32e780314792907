"""The roles' step logic: the verifier's and drafters' batch functions and their slot bookkeeping."""

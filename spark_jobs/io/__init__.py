"""spark_jobs/io"""

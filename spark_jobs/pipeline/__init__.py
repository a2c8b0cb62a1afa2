"""spark_jobs/pipeline"""
